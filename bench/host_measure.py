"""`pdserve plan --measure`: this host's bandwidth and FLOP/s, and, for a checkpoint, what reading
its weights and the engine's decode step really take.

bandwidth: reading a float32 buffer much larger than the last-level cache, in PROBE_PIECE pieces.
Weight read: the same kind of read over every weight tensor of the checkpoint, in its own dtype —
the bytes a decode step must stream, with no compute; the roofline's floor (weights / bandwidth)
should predict it. Each sweep reads the whole probe, then every weight tensor, so nothing is
still cached when it is read again; each piece and each tensor keeps its fastest time over the
sweeps, and the times add up. A busy neighbour only ever slows a read down and a short read is
rarely preempted, so the sums are what the memory system gives when left alone, on both sides.
FLOP/s: a square float32 matmul, best of repeats. Engine: `LLMEngine` on the checkpoint, its
fastest decode-only step at batch 1 and 8 (best of a dozen, for the same reason), for the floor
to stand next to. Everything runs with
`threads` torch threads (a worker's default is 1).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

PROBE_BYTES = 256 << 20
PROBE_PIECE = 4 << 20  # about one weight matrix of a small model; 64 pieces per sweep
GEMM_SIZE = 1024


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _best_sweeps(groups: list[list[Callable[[], object]]], sweeps: int) -> list[float]:
    """Per group: the sum over its reads of each read's fastest time, over `sweeps` sweeps that
    run every read of every group in order."""
    best = [[math.inf] * len(reads) for reads in groups]
    for _ in range(sweeps):
        for times, reads in zip(best, groups, strict=True):
            for i, read in enumerate(reads):
                times[i] = min(times[i], _time(read))
    return [sum(times) for times in best]


def reads(threads: int, checkpoint: Path | None = None, sweeps: int = 12) -> dict[str, float]:
    """{"bandwidth": bytes/s reading PROBE_BYTES} and, with a checkpoint, {"weight_read_s",
    "weights_bytes"}: reading every tensor of its *.safetensors once."""
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(threads)
    pieces = torch.rand(PROBE_BYTES // 4).split(PROBE_PIECE // 4)
    tensors = [t for f in sorted(checkpoint.glob("*.safetensors")) for t in load_file(f).values()] if checkpoint else []
    probe_s, weights_s = _best_sweeps([[p.sum for p in pieces], [t.sum for t in tensors]], sweeps)
    found = {"bandwidth": PROBE_BYTES / probe_s}
    if tensors:
        found |= {"weight_read_s": weights_s, "weights_bytes": sum(t.numel() * t.element_size() for t in tensors)}
    return found


def flops(threads: int, repeats: int = 5, dtype: str = "float32") -> float:
    """FLOP/s of a GEMM_SIZE^3 matmul (2 n^3 FLOPs) in `dtype` (float32, or bfloat16)."""
    import torch

    torch.set_num_threads(threads)
    a, b = (torch.rand(GEMM_SIZE, GEMM_SIZE, dtype=getattr(torch, dtype)) for _ in range(2))
    a @ b
    return 2 * GEMM_SIZE**3 / min(_time(lambda: a @ b) for _ in range(repeats))


def engine_decode(checkpoint: Path, threads: int, batches: tuple[int, ...] = (1, 8),
                  steps: int = 12) -> dict[int, float]:
    """The fastest wall time (s) of the engine's decode-only steps at each batch size."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from protocol.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model_path=str(checkpoint), num_blocks=256, torch_threads=threads,
                                    enable_prefix_caching=False))
    measured = {}
    for batch in batches:
        seen = engine.telemetry.last_seq
        for i in range(batch):
            engine.add_request(f"m{batch}-{i}", prompt_token_ids=[10 + i] * 8,
                               sampling=SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        walls = [r.wall_s for r in engine.telemetry.since(seen) if r.prefill_rows == 0 and r.decode_rows == batch]
        measured[batch] = min(walls)
    return measured
