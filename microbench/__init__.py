"""Engine and transfer micro-benchmarks, and the device check: tools that measure one engine step,
its linears, continuous batching, the KV transfer channels, or whether pdserve works on a device,
in-process and side by side. Clients of the engine, never imported by the serving path; each module
runs as `python -m microbench.<name>` and prints JSON with `--json`.
"""
