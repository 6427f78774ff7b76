"""The gRPC shell: servicers, error mapping and the server factory."""
