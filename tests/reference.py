"""Reference outputs from transformers' own `generate`, the yardstick for token-exactness."""

from __future__ import annotations

import copy
import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=4)
def _model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """Greedy continuation of one prompt; stops after EOS (inclusive) like the engine. Kept for
    the session: a checkpoint is never rewritten at the same path during one."""
    return list(_greedy(path, tuple(prompt_ids), max_new_tokens, ignore_eos))


@functools.lru_cache(maxsize=4096)
def _greedy(path: str, prompt_ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool) -> tuple[int, ...]:
    model = _model(path)
    eos = model.generation_config.eos_token_id
    config = copy.deepcopy(model.generation_config)
    # ignore_eos: an id no token can take, so generate never stops early
    config.eos_token_id = model.config.vocab_size + 1 if ignore_eos else eos
    config.pad_token_id = eos
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    with torch.inference_mode():
        out = model.generate(torch.tensor([list(prompt_ids)]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             generation_config=config)
    tokens = out[0, len(prompt_ids):].tolist()
    if not ignore_eos and eos in tokens:
        tokens = tokens[:tokens.index(eos) + 1]
    return tuple(tokens)


def record_prefill_chunks(engine) -> dict[str, list[int]]:
    """Wrap the scheduler: the size of every prompt chunk it schedules, per request."""
    chunks: dict[str, list[int]] = {}
    schedule = engine.scheduler.schedule

    def recording():
        items = schedule()
        for it in items:
            if it.start < it.request.num_prompt_tokens:
                chunks.setdefault(it.request.request_id, []).append(it.num_tokens)
        return items

    engine.scheduler.schedule = recording
    return chunks


def bf16_near_ties(path: str, prompt_ids: list[int], tokens: list[int], ulps: int = 1) -> list[tuple[int, float]]:
    """Teacher-forced along `tokens` (an engine's bfloat16 greedy output), transformers' bfloat16
    logits at each step: every token must be the argmax, or within `ulps` bfloat16 roundings of it
    at the top logit's magnitude (two GEMMs that sum in different orders, AMX tiles and oneDNN's,
    may round a logit a step apart). Returns [(step, gap in ulps)] of the steps where the token was
    not the argmax (a gap of 0: its logit equals the top, and argmax takes the first column); an
    AssertionError where one is further off than `ulps`."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + tokens[:-1]])).logits[0, len(prompt_ids) - 1:].float()
    ties = []
    for step, (row, token) in enumerate(zip(logits, tokens, strict=True)):
        top = row.max()
        ulp = 2.0 ** (torch.floor(torch.log2(top.abs())).item() - 7)  # bfloat16: 8 significant bits
        gap = float((top - row[token]) / ulp)
        assert gap <= ulps, f"step {step}: token {token} is {gap:.1f} bfloat16 steps under the top logit"
        if token != int(row.argmax()):
            ties.append((step, gap))
    return ties
