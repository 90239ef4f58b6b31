"""`pdserve plan --measure`: this host's bandwidth and FLOP/s, and, for a checkpoint, what reading
its weights and the engine's decode step really take.

bandwidth: reading one float32 buffer much larger than the last-level cache (a sum over it).
FLOP/s: a square float32 matmul. Weight read: the same read over every weight tensor of the
checkpoint, in its own dtype — the bytes a decode step must stream, with no compute; the
roofline's floor (weights / bandwidth) should predict it. Both reads are interleaved, so a noisy
neighbour slows both alike. Engine: `LLMEngine` on the checkpoint, decode-only steps at batch 1
and 8, for the floor to stand next to. Everything runs with `threads` torch threads (a worker's
default is 1); each figure is a median of repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

PROBE_BYTES = 256 << 20
GEMM_SIZE = 1024


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def reads(threads: int, checkpoint: Path | None = None, repeats: int = 9) -> dict[str, float]:
    """{"bandwidth": bytes/s of reading a PROBE_BYTES buffer} and, with a checkpoint,
    {"weight_read_s", "weights_bytes"}: one read of every tensor of its *.safetensors."""
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(threads)
    probe = torch.rand(PROBE_BYTES // 4)
    tensors = [t for f in sorted(checkpoint.glob("*.safetensors")) for t in load_file(f).values()] if checkpoint else []
    read_probe, read_weights = (lambda: probe.sum()), (lambda: [t.sum() for t in tensors])
    read_probe(), read_weights()  # warm: first-touch page faults, the thread pool
    probe_s, weights_s = [], []
    for _ in range(repeats):
        probe_s.append(_time(read_probe))
        weights_s.append(_time(read_weights))
    found = {"bandwidth": PROBE_BYTES / statistics.median(probe_s)}
    if tensors:
        found |= {"weight_read_s": statistics.median(weights_s),
                  "weights_bytes": sum(t.numel() * t.element_size() for t in tensors)}
    return found


def flops(threads: int, repeats: int = 5) -> float:
    """FLOP/s of a GEMM_SIZE^3 float32 matmul (2 n^3 FLOPs)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.rand(GEMM_SIZE, GEMM_SIZE), torch.rand(GEMM_SIZE, GEMM_SIZE)
    a @ b
    return 2 * GEMM_SIZE**3 / statistics.median(_time(lambda: a @ b) for _ in range(repeats))


def engine_decode(checkpoint: Path, threads: int, batches: tuple[int, ...] = (1, 8),
                  steps: int = 12) -> dict[int, float]:
    """Median wall time (s) of the engine's decode-only steps at each batch size."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

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
        measured[batch] = statistics.median(walls[1:] or walls)  # the first decode step warms caches
    return measured
