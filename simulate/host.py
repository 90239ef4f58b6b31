"""`--emulate host`: this host's own profile for the config's checkpoint, so a simulation can be
checked against the real CPU cluster on the same workload.

The engine runs a spread of step shapes on the checkpoint in this process (decode batches of 1-8,
prefill chunks of 32-256 tokens), the bandwidth is measured as `pdserve plan --measure` does, and
bench/calibrate.py fits bytes / bandwidth + FLOPs / peak + overhead to the steps' wall times. The
result is an emulated `custom` device with that bandwidth and FLOP/s (efficiencies 1). The KV
link is loopback gloo between two processes (HOST_LINK), the weights load is not modelled.
`--emulate steps:FILE[@ARR]` fits the same model to a real bench run's steps instead (the run's
own contention included); `run:DIR[@ARR]` too, and adds the serving path fitted to the run's
requests (simulate/serving.py: door and call latencies, the spread of steps and deliveries).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from bench.calibrate import HostFit, fit, measure_steps
from router.config.emulate import EmulateSection
from router.config.schema import ClusterConfig
from simulate.serving import ServingFit, fit_serving
from sizing.cost_model import Emulation, StepTotals

HOST_LINK = {"link": "2GB/s", "link_latency_s": 0.001, "load_bandwidth": "1000GB/s"}


def host_section(config: ClusterConfig, threads: int = 1, steps: str | None = None) -> tuple[EmulateSection, HostFit]:
    """The emulate section of this host running the config's checkpoint, and the fit behind it:
    fitted to steps run now on a spread of shapes, or with `steps` ("FILE" or "FILE@ARRANGEMENT")
    to the steps a real run recorded (`pdserve bench`'s steps.jsonl: the calibration fit, which
    shares that run's contention: two engines and a router on the same cores)."""
    from bench import host_measure
    from engine.forward.dense import cpu_computes_bf16

    checkpoint = Path(config.model.path)
    dtype = config.model.dtype if config.model.dtype != "auto" else ("bfloat16" if cpu_computes_bf16() else "float32")
    if steps is None:
        print(f"simulate: measuring this host with {checkpoint.name} ({dtype}, {threads} torch thread)...",
              file=sys.stderr)
        measured = measure_steps(checkpoint, threads=threads)
    else:
        measured = recorded_steps(*steps.partition("@")[::2])
    bandwidth = host_measure.reads(threads)["bandwidth"]
    found = fit(checkpoint, dtype, measured, bandwidth)
    values = found.emulate_section(str(checkpoint), dtype) | HOST_LINK
    print(f"simulate: host fit {found.bandwidth / 1e9:.2f} GB/s, {found.flops / 1e9:.1f} GFLOP/s, "
          f"{found.overhead_s * 1e3:.2f} ms a step (rms error {found.rms_error_s * 1e3:.2f} ms over {found.steps} steps)",
          file=sys.stderr)
    return dataclasses.replace(config.emulate, **values), found


def recorded_run(text: str) -> str:
    """`--emulate steps:FILE[@ARR]` or `run:DIR[@ARR]` as host_section's `steps` ("FILE@ARR")."""
    if text.startswith("run:"):
        run_dir, _, arrangement = text.removeprefix("run:").partition("@")
        return f"{Path(run_dir) / 'steps.jsonl'}@{arrangement}"
    return text.removeprefix("steps:")


def serving_fit(text: str, emulation: Emulation) -> ServingFit | None:
    """`--emulate run:DIR[@ARR]`: the host's serving path fitted to that bench run's records, against
    the host model fitted to its steps (`emulation`); None for any other --emulate."""
    if not text.startswith("run:"):
        return None
    run_dir, _, arrangement = text.removeprefix("run:").partition("@")
    found = fit_serving(Path(run_dir), arrangement, emulation.cost)
    print(f"simulate: {found.describe()}", file=sys.stderr)
    return found


def recorded_steps(path: str, arrangement: str = "") -> list[tuple[StepTotals, float]]:
    """(totals, wall seconds) of the steps in a bench run's steps.jsonl (one arrangement's, if named)."""
    try:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--emulate steps:{path}: {err}") from None
    out = [(StepTotals(r["decode_rows"] + r["prefill_tokens"], r["context_tokens"], r["attended_pairs"]), r["wall_s"])
           for r in rows if (not arrangement or r.get("arrangement") == arrangement)
           and r["decode_rows"] + r["prefill_tokens"] > 0]
    if len(out) < 3:
        raise ValueError(f"--emulate steps:{path}: {len(out)} steps of {arrangement or 'any arrangement'}; "
                         "a fit needs at least 3")
    return out
