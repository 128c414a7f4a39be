"""Generated gRPC stubs for protos/tandem/v1 (scripts/gen_protos.py); do not edit."""
