"""microbench/schedule.py's `RunShape`: a burst's wall time split into decode-only steps and steps
with prompt tokens."""

from __future__ import annotations

import pytest

from microbench.schedule import RunShape
from sizing.cost_model import StepItem


def test_steps_are_split_by_whether_they_carry_prompt_tokens():
    shape = RunShape()
    shape.add((StepItem(300, 300),), 0.2)  # a prompt alone
    shape.add((StepItem(1, 301), StepItem(200, 200)), 0.2)  # a decode row beside a prompt
    shape.add((StepItem(1, 302), StepItem(1, 201)), 0.03)  # decode rows only
    shape.add((StepItem(1, 303),), 0.01)
    got = shape.as_dict()
    assert got["decode_only_steps"] == 2 and got["decode_only_s"] == pytest.approx(0.04)
    assert got["decode_only_p50_s"] == pytest.approx(0.02)
    assert got["prompt_steps"] == 2 and got["prompt_s"] == pytest.approx(0.4)
    assert got["prompt_tok_s"] == pytest.approx(500 / 0.4)  # the prompts' tokens, not the decode row


def test_an_empty_burst_has_no_rates():
    got = RunShape().as_dict()
    assert got["decode_only_steps"] == got["prompt_steps"] == 0 and got["prompt_tok_s"] == 0.0
