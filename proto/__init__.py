"""pdserve's gRPC API: `pdserve.proto` and the modules generated from it (see proto/gen_proto.py)."""
