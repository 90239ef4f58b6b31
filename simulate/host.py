"""`--emulate host`: this host's own profile for the config's checkpoint, so a simulation can be
checked against the real CPU cluster on the same workload.

The engine runs a spread of step shapes on the checkpoint in this process (decode batches of 1-8,
prefill chunks of 32-256 tokens), the bandwidth is measured as `pdserve plan --measure` does, and
bench/calibrate.py fits bytes / bandwidth + FLOPs / peak + overhead to the steps' wall times. The
result is an emulated `custom` device with that bandwidth and FLOP/s (efficiencies 1). The KV
link is loopback gloo between two processes (HOST_LINK), the weights load is not modelled.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from bench.calibrate import HostFit, fit, measure_steps
from router.config.emulate import EmulateSection
from router.config.schema import ClusterConfig

HOST_LINK = {"link": "2GB/s", "link_latency_s": 0.001, "load_bandwidth": "1000GB/s"}


def host_section(config: ClusterConfig, threads: int = 1) -> tuple[EmulateSection, HostFit]:
    """The emulate section of this host running the config's checkpoint, and the fit behind it."""
    from bench import host_measure
    from engine.dense import cpu_computes_bf16

    checkpoint = Path(config.model.path)
    dtype = config.model.dtype if config.model.dtype != "auto" else ("bfloat16" if cpu_computes_bf16() else "float32")
    print(f"simulate: measuring this host with {checkpoint.name} ({dtype}, {threads} torch thread)...", file=sys.stderr)
    bandwidth = host_measure.reads(threads)["bandwidth"]
    found = fit(checkpoint, dtype, measure_steps(checkpoint, threads=threads), bandwidth)
    values = found.emulate_section(str(checkpoint), dtype) | HOST_LINK
    print(f"simulate: host fit {found.bandwidth / 1e9:.2f} GB/s, {found.flops / 1e9:.1f} GFLOP/s, "
          f"{found.overhead_s * 1e3:.2f} ms a step (rms error {found.rms_error_s * 1e3:.2f} ms over {found.steps} steps)",
          file=sys.stderr)
    return dataclasses.replace(config.emulate, **values), found
