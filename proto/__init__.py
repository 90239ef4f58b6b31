"""pdserve's gRPC API: `pdserve.proto` and the modules generated from it (see scripts/gen_proto.py)."""
