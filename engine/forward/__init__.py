"""The CPU and GPU forward paths of one engine step, below the request loop.

`switchboard.Forward` picks the path a step takes (compiled, CUDA graphs, the kernel decoder, the
lean decoder, or the model's own forward) and the greedy head; the paths are dense (prepacked
linears), fused (stacked linears), kernel_layer / kernel_decoder (a layer, or the decoder, as one
C call), lean_decoder (the modules as direct calls), attention (paged attention) and features
(what each layer's attention asks). They import the kernels, never the scheduler or the engine.
"""
