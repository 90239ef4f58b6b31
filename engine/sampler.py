"""Token sampling: greedy for the whole batch in one argmax, then per-request sampling
(temperature, top-k, top-p).

A seeded request's generator is re-seeded from (seed, output index) right before each draw,
so its token at output index i depends only on (seed, i, logits): a request resumed on
another worker, or recomputed after preemption, draws exactly what it would have drawn.
Requests without a seed share the engine's default generator.
"""

from __future__ import annotations

import logging

import torch

from engine.request import Request

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def greedy(logits: torch.Tensor, argmax=None) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for `[N, V]` rows: by `argmax` (the engine's CPU kernel,
    cpu_ops.Argmax, where it runs them: torch's runs one thread, 0.45 ms for 16 x 49k logits
    here) when the rows are float32 or bfloat16 on the CPU (bfloat16 read as they are: the argmax of
    the rows widened to float32, exactly), else by torch."""
    if (argmax is not None and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.device.type == "cpu"
            and logits.shape[1] > 0 and logits.stride(1) == 1):
        return argmax(logits)
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, requests: list[Request], default_gen: torch.Generator, argmax=None) -> list[int]:
    """logits `[N, V]` float32, one row per request -> one token id per request."""
    tokens = greedy(logits, argmax).tolist()
    for i, req in enumerate(requests):
        if not req.sampling.greedy:
            tokens[i] = _sample_row(logits[i], req, _generator(req, default_gen))
    return tokens


def sample_isolated(logits: torch.Tensor, requests: list[Request],
                    default_gen: torch.Generator, argmax=None) -> list[int | Exception]:
    """Like `sample`, but a request whose sampling raises gets its exception instead of a token
    and the others still get theirs: the batch is tried first, then row by row."""
    try:
        return sample(logits, requests, default_gen, argmax)
    except Exception as e:
        log.warning("batched sampling failed (%s); sampling row by row", e)
        return [_sample_alone(logits[i:i + 1], req, default_gen, argmax) for i, req in enumerate(requests)]


def _sample_alone(logits: torch.Tensor, req: Request, default_gen: torch.Generator, argmax=None) -> int | Exception:
    try:
        return sample(logits, [req], default_gen, argmax)[0]
    except Exception as e:
        log.exception("sampling failed for request %r", req.request_id)
        return e


def draw_seed(seed: int, index: int) -> int:
    """A 63-bit seed for draw `index` of a request seeded with `seed` (splitmix64 finalizer)."""
    x = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & (_MASK64 >> 1)


def _generator(req: Request, default_gen: torch.Generator) -> torch.Generator:
    if req.sampling.seed is None:
        return default_gen
    if req.generator is None:
        req.generator = torch.Generator()
    return req.generator.manual_seed(draw_seed(req.sampling.seed, len(req.output_token_ids)))


def _sample_row(row: torch.Tensor, req: Request, gen: torch.Generator) -> int:
    p = req.sampling
    # on the CPU, where the generators live; minus the max first, so that dividing by a tiny
    # temperature gives -inf at worst (never inf - inf = nan)
    row = row.float().cpu()  # [V]
    row = (row - row.max()) / p.temperature
    if p.top_k and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        row = _top_p(row, p.top_p)
    probs = torch.softmax(row, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def _top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p`."""
    sorted_logits, order = torch.sort(row, descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token already enough
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(row).scatter_(0, order, sorted_logits)
