"""pdserve's CPU kernels: the C sources (csrc/, one header `pdserve_kernels.h` declaring every
export), their build (kernel_build), the ctypes bindings (cpu_kernel, cpu_gemm, cpu_ops) with the
argument checks at the boundary (kernel_checks), and huge-page allocation for what they read.
Nothing here imports the forward paths or the request loop.
"""
