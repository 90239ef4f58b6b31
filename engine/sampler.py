"""Token sampling: greedy for the whole batch in one argmax, then per-request sampling
(temperature, top-k, top-p) with the request's own generator so a seed reproduces tokens."""

from __future__ import annotations

import torch

from engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request], default_gen: torch.Generator) -> list[int]:
    """logits `[N, V]` float32, one row per request -> one token id per request."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, req in enumerate(requests):
        if not req.sampling.greedy:
            tokens[i] = _sample_row(logits[i], req, req.generator or default_gen)
    return tokens


def _sample_row(row: torch.Tensor, req: Request, gen: torch.Generator) -> int:
    p = req.sampling
    row = row / p.temperature  # [V]
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
