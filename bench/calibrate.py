"""Fit this host's cost model for a checkpoint, so an emulated cluster can stand in for a real one
(bench/emulation_check.py checks how well).

The steps come from one of two places: `measure_steps` runs the engine on a spread of step shapes
(decode batches of 1 to 8, prefill chunks of 32 to 256 tokens) in this process; `from_records`
takes the step records of a real run (engine/telemetry.py: each carries its tokens, the KV it read
and its attention pairs), so the fit shares that run's contention. Each step's bytes and FLOPs come
from sizing/cost_model.py (the emulated model being the checkpoint itself), its wall time from the
engine's step record. Every
step reads the same weights, so bytes and a fixed overhead cannot be told apart from the steps
alone: the bandwidth is measured directly (bench/host_measure.py, as `pdserve plan --measure`)
and a least-squares fit of wall - bytes / bandwidth = overhead + FLOPs / peak gives the effective
FLOP/s and the per-step overhead. The result is an `emulate:` section with device `custom` and
efficiencies 1. The cost model takes the larger of the two terms, not their sum: on a CPU a
decode step is nearly all reads and a long chunk nearly all FLOPs, so the two stay close there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocol.telemetry import StepRecord
from router.config.emulate import emulated_shape
from sizing.cost_model import CostModel, StepTotals
from sizing.devices import DeviceProfile
from sizing.memory import dtype_bytes

DECODE_BATCHES = (1, 2, 4, 8)
PREFILL_CHUNKS = (32, 64, 128, 256)


@dataclass(frozen=True)
class HostFit:
    bandwidth: float  # effective bytes/s of a step's reads
    flops: float  # effective FLOP/s of a step's matmuls
    overhead_s: float
    steps: int
    rms_error_s: float  # of the fit over the steps it was made from

    def emulate_section(self, model: str, dtype: str) -> dict:
        """cluster.yaml's `emulate:` for this host running `model`."""
        return {"device": "custom", "model": model, "dtype": dtype, "bandwidth": f"{self.bandwidth:.6g}",
                "flops": f"{self.flops:.6g}", "memory": "64GiB", "bandwidth_efficiency": 1.0,
                "compute_efficiency": 1.0, "step_overhead_s": round(self.overhead_s, 6)}


def from_records(records: list[StepRecord]) -> list[tuple[StepTotals, float]]:
    """(totals, wall seconds) of recorded steps that computed something."""
    return [(StepTotals(r.decode_rows + r.prefill_tokens, r.context_tokens, r.attended_pairs), r.wall_s)
            for r in records if r.decode_rows + r.prefill_tokens > 0]


def measure_steps(checkpoint: Path, threads: int = 1, repeats: int = 3) -> list[tuple[StepTotals, float]]:
    """(totals, wall seconds) of the engine's steps over the calibration shapes."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from protocol.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model_path=str(checkpoint), num_blocks=512, torch_threads=threads,
                                    enable_prefix_caching=False, max_num_batched_tokens=256, chunk_size=256))
    plans = [(b, 16, 8) for b in DECODE_BATCHES] + [(1, n, 1) for n in PREFILL_CHUNKS]
    start = engine.telemetry.last_seq  # not a warm-up's
    for r in range(repeats):
        for batch, prompt, outputs in plans:
            for i in range(batch):
                engine.add_request(f"c{r}-{batch}-{prompt}-{i}", prompt_token_ids=[20 + i + r] * prompt,
                                   sampling=SamplingParams(max_tokens=outputs, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
    return from_records(engine.telemetry.since(start))


def fit(checkpoint: Path, dtype: str, measured: list[tuple[StepTotals, float]], bandwidth: float) -> HostFit:
    """Least squares of wall - bytes / bandwidth = overhead + FLOPs x b, both kept >= 0."""
    unit = CostModel(emulated_shape(str(checkpoint)), DeviceProfile("unit", 1.0, 1.0, "1B", ""), dtype_bytes(dtype))
    flops = np.array([unit.step_flops(s) for s, _ in measured])
    reads = np.array([unit.step_bytes(s) for s, _ in measured]) / bandwidth
    y = np.array([wall for _, wall in measured]) - reads
    x = np.stack([np.ones_like(flops), flops / flops.max()], axis=1)
    (overhead, per_flop), *_ = np.linalg.lstsq(x, y, rcond=None)
    overhead, per_flop = max(float(overhead), 0.0), max(float(per_flop) / flops.max(), 1e-30)
    residual = y - overhead - flops * per_flop
    return HostFit(bandwidth, 1.0 / per_flop, overhead, len(measured), float(np.sqrt(np.mean(residual**2))))
