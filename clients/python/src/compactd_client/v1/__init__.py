"""Generated from protos/compactd/v1 by clients/python/generate; do not edit."""
