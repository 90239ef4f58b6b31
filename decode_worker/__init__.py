"""Decode worker: owns a paged KV pool, receives prompt KV from prefill workers, and runs the
continuous-batching decode loop (colocated mode: prefills its own prompts too)."""
