"""`pdserve simulate`: the cluster's own router and engine schedulers on a virtual clock.

The router (admission, placement, the request lifecycle, the monitor, the pool manager) and the
workers' actor code (the real `PrefillWorker` and `DecodeWorker` methods, their hand-off table,
KV pusher, outbox) and engines (`LLMEngine`: scheduler, KV cache manager, prefix cache) run
unchanged in one process on a looptime event loop. Only what needs a device is modelled: a step
takes the cost model's time for its shape (sizing/cost_model.py), a KV piece the link model's,
a start the weights load's; tokens come from a deterministic stream (simulate/engine.py).
docs/simulate.md walks through it and states its measured error.
"""
