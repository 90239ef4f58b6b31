"""Sizing, the ground floor: the memory budget and KV pool rule (memory), accelerator profiles
(devices) and the per-step cost model (cost_model). Pure arithmetic over a model's shape; the
engine, the router's config checks, bench and the simulator all size a pool through
`memory.kv_pool_blocks` / `memory.resolve_dtype`, so they cannot disagree.
"""
