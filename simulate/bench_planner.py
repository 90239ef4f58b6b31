"""The planner's runs of simulate/bench_autoscale.py: its config per case, the comparison with the
cheapest static arrangement, the steady run's actions after settling, and the blind planner.

The blind planner is the same `Planner`, fed what Dynamo's planner saw in #10528: demand as
completions (arrivals := finished requests) and latency only of finished requests (the queue,
the waits of requests without a first token, KV waits and prefill backlog read as zero). It is
built here, around the autoscaler's `observe`, not by a switch in the planner.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from bench.arrangements import arrangement_config
from bench.metrics import Slo
from bench.workload import Workload
from router.config.schema import ClusterConfig
from simulate.autoscale import AUTOSCALED, _one, autoscaled_config, verdict
from simulate.autoscale_plot import plot_timeline

ATTAINMENT, RATIO = 0.9, 0.7  # the targets
SETTLE_S = 600.0  # the steady run: changes after its first 10 simulated minutes count against it
BUDGET = {"swinging": 32, "swinging-long": 32, "conversation": 16, "conversation-4x": 64, "steady": 16,
          "steady-default": 16, "bursty": 16}
# The swinging case compresses a day into three minutes, so the planner's pacing is compressed with
# it; every other case (swinging-long's 30-minute day too) runs at the defaults (10 s interval,
# 30 s / 120 s cooldowns, 30 s warm-up). The steady case takes the compressed pacing
# too: shorter cooldowns give oscillation more chances, a stricter test.
COMPRESSED = {"interval_s": 5.0, "scale_up_cooldown_s": 10.0, "scale_down_cooldown_s": 30.0, "warmup_s": 10.0}
PACING = {"swinging": COMPRESSED, "steady": COMPRESSED}
PLANNER_MODES = ("disaggregated", "colocated")  # the planner's arrangement: two pools, or one (router.autoscale)


def planner_config(case_name: str, base: ClusterConfig, slo: Slo, price: float,
                   mode: str = "disaggregated") -> ClusterConfig:
    """The case's cluster with its planner, SLOs from the case's, the budget: disaggregated, 2P+2D to
    begin; colocated (one pool, chunked prefill, as the colocated-N statics), 4 workers to begin."""
    budget = BUDGET[case_name]
    if mode not in PLANNER_MODES:
        raise ValueError(f"planner mode {mode!r}: expected one of {', '.join(PLANNER_MODES)}")
    start = dataclasses.replace(base, mode="disaggregated", prefill=dataclasses.replace(base.prefill, replicas=2),
                                decode=dataclasses.replace(base.decode, replicas=2)) if mode == "disaggregated" \
        else arrangement_config(base, "colocated-chunked", 4)
    slos = {"ttft_s": slo.ttft_s} | ({"itl_s": slo.tpot_s} if slo.tpot_s else {})
    return autoscaled_config(start, prefill_min=1, decode_min=1, prefill_max=budget - 1,
                             decode_max=budget - 1 if mode == "disaggregated" else budget,
                             max_workers=budget, cost_per_worker_hour=price, percentile=90.0, **slos,
                             **PACING.get(case_name, {}))


def command(case, statics: list[str], mode: str = "disaggregated") -> str:
    flags = " ".join(shlex.quote(f) for f in case.flags)
    how = "" if mode == "disaggregated" else f", mode='{mode}'"
    return (f"pdserve simulate --config simulate/gpu_cluster.yaml --emulate h100:llama-3.1-8b {flags} "
            f"--slo {case.slo} --autoscale --statics {','.join(statics)} --json   # router.autoscale as "
            f"simulate.bench_planner.planner_config('{case.name}'{how}) sets it")


def _save(out: Path, name: str, timeline: dict, wl: Workload) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-timeline.json").write_text(json.dumps(timeline, indent=1))
    return plot_timeline(timeline, [r.arrival_s for r in wl.requests], str(out / f"{name}.png"), f"{name}: the planner")


def planner_run(case, base, em, wl: Workload, slo: Slo, price: float, out: Path,
                mode: str = "disaggregated") -> tuple[dict, dict]:
    """The planner's row of the case and its timeline (saved with its plot under `out`; the
    colocated planner's as CASE-colocated)."""
    cfg = planner_config(case.name, base, slo, price, mode)
    _, row, timeline = _one((AUTOSCALED, cfg, em, wl, slo, 0, price))
    name = case.name if mode == "disaggregated" else f"{case.name}-{mode}"
    timeline["plot"] = _save(out, name, timeline, wl)
    timeline["mode"] = mode
    return row, timeline


def compare_result(case, row: dict, timeline: dict, statics: dict[str, dict]) -> dict[str, Any]:
    result = verdict(row, statics, ATTAINMENT)
    ratio = result["worker_hours_ratio"]
    result["targets"] = {"attainment_ge_0.9": row["slo_attainment"] >= ATTAINMENT,
                         "worker_hours_ratio_le_0.7": ratio is not None and ratio <= RATIO}
    result["plot"] = timeline["plot"]
    result["planner_host_s"] = timeline["host_s"]
    mode = timeline.get("mode", "disaggregated")
    result["planner_mode"] = mode
    result["command"] = command(case, list(statics), mode)
    return result


def compare_modes(case, runs: dict[str, tuple[dict, dict]], statics: dict[str, dict]) -> dict[str, Any]:
    """The issue's shape for the planner the case names (`case.planner`, else the first run), and
    beside it, under `planners`, every mode run with its own ratio to the same cheapest static."""
    mine = case.planner if case.planner in runs else next(iter(runs))
    result = compare_result(case, *runs[mine], statics)
    if len(runs) > 1:
        result["planners"] = {}
        for mode, (row, timeline) in runs.items():
            one = compare_result(case, row, timeline, statics)
            result["planners"][mode] = {k: one[k] for k in ("autoscaled", "worker_hours_ratio", "targets", "plot",
                                                             "planner_host_s", "command")}
    return result


def measure_compare(case, base, em, wl: Workload, slo: Slo, statics: dict[str, dict], price: float,
                    out: Path) -> dict[str, Any]:
    row, timeline = planner_run(case, base, em, wl, slo, price, out)
    return compare_result(case, row, timeline, statics)


def settled_actions(decisions: list[dict], settle_s: float) -> int:
    """Changes the planner asked for after `settle_s` (seconds from the first arrival)."""
    return sum(1 for d in decisions if d["changed"] and d["at"] >= settle_s)


def measure_steady(case, base, em, wl: Workload, slo: Slo, price: float, out: Path) -> dict[str, Any]:
    cfg = planner_config(case.name, base, slo, price)
    _, row, timeline = _one((AUTOSCALED, cfg, em, wl, slo, 0, price))
    changes = [round(d["at"], 1) for d in timeline["decisions"] if d["changed"]]
    after = settled_actions(timeline["decisions"], SETTLE_S)
    return {"autoscaled": row, "settle_s": SETTLE_S, "actions_after_settling": after, "changes_at_s": changes,
            "targets": {"actions_after_settling_le_2": after <= 2, "no_failed_request": row["failed"] == 0},
            "plot": _save(out, case.name, timeline, wl), "planner_host_s": timeline["host_s"],
            "command": command(case, [])}


def _blind_one(job: tuple) -> tuple:
    """`_one` with the autoscaler's observation stripped to what a completions-only planner sees."""
    from router.autoscale import loop

    seen = loop.Autoscaler.observe

    async def blind(self):
        obs = await seen(self)
        pools = {p: dataclasses.replace(po, queued_tokens=0) for p, po in obs.pools.items()}
        return dataclasses.replace(obs, arrivals=obs.finished, queued=0, queued_prompt_tokens=0, waiting_first=0,
                                   wait_q_s=0.0, oldest_wait_s=0.0, kv_waiting=0, kv_waiting_tokens=0, pools=pools,
                                   waiting_prompts=())
    loop.Autoscaler.observe = blind
    try:
        return _one(job)
    finally:
        loop.Autoscaler.observe = seen


def measure_blind(case, base, em, wl: Workload, slo: Slo, price: float, out: Path) -> dict[str, Any]:
    cfg = planner_config(case.name, base, slo, price)
    job = (AUTOSCALED, cfg, em, wl, slo, 0, price)
    _, seeing, seeing_timeline = _one(job)
    _, blind, blind_timeline = _blind_one(job)
    return {"autoscaled": seeing, "blind_to_queue_wait": blind,
            "targets": {"planner_attainment_ge_0.9": seeing["slo_attainment"] >= ATTAINMENT,
                        "blind_attainment_lt_0.9": blind["slo_attainment"] < ATTAINMENT},
            "plots": [_save(out, case.name, seeing_timeline, wl), _save(out, f"{case.name}-blind", blind_timeline, wl)],
            "command": command(case, [])}
