"""The pure domain core: folds, projections, pricing and planning. No I/O, no gRPC, no clock."""
