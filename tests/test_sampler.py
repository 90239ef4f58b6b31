"""The sampler alone (engine/sampler.py): a seeded draw depends only on its seed, output index and
logits; top-k and top-p never leave their support sets; a tiny temperature samples the argmax."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.request import Request
from engine.sampler import sample
from protocol.sampling import SamplingParams


def _req(sp: SamplingParams, seed: int, num_outputs: int = 0) -> Request:
    return Request("x", [1], replace(sp, seed=seed), detokenizer=None, output_token_ids=[0] * num_outputs)


def test_a_seeded_draw_depends_only_on_seed_index_and_logits():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(1))
    sp = SamplingParams(temperature=1.0)
    fresh = [sample(logits, [_req(sp, 42, i)], torch.Generator())[0] for i in range(40)]
    req = _req(sp, 42)
    for i in range(40):  # one request drawing in order, its generator reused
        assert sample(logits, [req], torch.Generator().manual_seed(i))[0] == fresh[i]
        req.output_token_ids.append(0)
    assert len(set(fresh)) > 10, "draws at different output indices must differ"
    assert fresh != [sample(logits, [_req(sp, 43, i)], torch.Generator())[0] for i in range(40)]


@pytest.mark.parametrize("temperature", [1e-30, 1.2e-38])
def test_a_tiny_temperature_samples_the_argmax(temperature):
    logits = 30 * torch.randn(4, 500, generator=torch.Generator().manual_seed(2))
    for sp in (SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_p=0.5, top_k=3)):
        reqs = [_req(sp, s) for s in range(4)]
        assert sample(logits, reqs, torch.Generator()) == logits.argmax(dim=-1).tolist()


def test_top_k_never_leaves_the_k_best():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(0))
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    sp = SamplingParams(temperature=2.0, top_k=5)
    seen = {sample(logits, [_req(sp, s)], torch.Generator())[0] for s in range(300)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_never_leaves_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = probs.log()[None]
    sp = SamplingParams(temperature=1.0, top_p=0.75)  # nucleus = {0, 1}: 0.5 + 0.3 reaches 0.75
    seen = {sample(logits, [_req(sp, s)], torch.Generator())[0] for s in range(300)}
    assert seen == {0, 1}
