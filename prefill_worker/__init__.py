"""Prefill worker: computes prompts (chunked, batched under a token budget), samples the first
token, and pushes the prompt's KV blocks to the decode worker the router chose."""
