"""The router: gRPC and HTTP front doors, request lifecycle, placement, pools, CLI, bench."""
