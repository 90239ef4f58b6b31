"""The model engine: paged KV cache, prefix cache, scheduler, model runner, sampler, detokenizer.

`LLMEngine` is the entry point: add requests, call `step()` until they finish. The prefill
worker runs it with `prefill_only` requests; the decode worker admits requests whose KV
arrived from a prefill worker with `add_prefilled`. What crosses a process boundary (sampling
parameters, outputs, hand-off messages) is not here but in `protocol/`.
"""
