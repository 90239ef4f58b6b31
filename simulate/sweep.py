"""`pdserve simulate --sweep`: the seed's study at GPU-cluster scale, in one command.

For each cluster size N (`--sizes`, devices), every arrangement at N devices -- colocated with
chunked prefill, and disaggregated at every P:D split (P = 1 .. N-1; `--splits eighths` keeps
P in N/8 steps) -- replays the workload at each request rate (`--rates`, requests/s per device, so
every size sees the same load per device) on the virtual clock, and is scored by the SLO:
attainment (the share of requests meeting every objective) at each rate, its knee (the highest
rate at which attainment stays at or above `--attainment`, interpolated between the two rates
around the crossing), and goodput per device at SLO, the knee / N (DistServe's measure). The
recommendation is the arrangement with the most goodput per device; the margin is over the next
best. Runs are spread over this host's cores (one process each); each is deterministic.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from bench.arrangements import arrangement_config
from bench.metrics import Slo, summarize_run
from bench.workload import Workload
from router.config.schema import ClusterConfig
from simulate.parallel import process_count, run_jobs
from sizing.cost_model import Emulation

ATTAINMENT = 0.9  # DistServe's target: 90% of requests within every SLO


def arrangements(base: ClusterConfig, n: int, splits: str) -> dict[str, ClusterConfig]:
    """Every arrangement of `n` devices: colocated (chunked) and disaggregated at each P:D."""
    out = {f"colocated-{n}": arrangement_config(base, "colocated-chunked", n)}
    step = max(1, n // 8) if splits == "eighths" else 1
    for p in range(step, n, step):
        out[f"{p}P{n - p}D"] = arrangement_config(base, "disaggregated", n, prefill_workers=p)
    return out


def retimed(workload: Workload, rate: float) -> Workload:
    """The same requests, their arrivals scaled so the mean rate is `rate` requests/s."""
    span = max(r.arrival_s for r in workload.requests) or 1.0
    k = (len(workload.requests) - 1) / span / rate if len(workload.requests) > 1 else 1.0
    return dataclasses.replace(workload, requests=tuple(dataclasses.replace(r, arrival_s=r.arrival_s * k)
                                                        for r in workload.requests))


def _one(job: tuple) -> tuple[str, int, float, dict[str, Any], float]:
    from simulate.run import simulate  # the router's code: loaded by a run, not by a usage error

    name, n, rate, cfg, em, workload, slo, seed = job
    run = simulate(cfg, em, retimed(workload, rate * n), name, seed, check=False)
    s = summarize_run(run.records, slo)
    return name, n, rate, {"slo_attainment": s["slo_attainment"], "goodput_req_per_s": s["goodput_req_per_s"],
                           "errors": s["num_errors"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                           "itl_p99_ms": s["itl_ms"]["p99"]}, run.host_s


def sweep(base: ClusterConfig, em: Emulation, workload: Workload, sizes: list[int], rates: list[float],
          slo: Slo, seed: int = 0, splits: str = "all", attainment: float = ATTAINMENT,
          processes: int | None = None) -> dict[str, Any]:
    jobs = [(name, n, rate, cfg, em, workload, slo, seed) for n in sizes
            for name, cfg in arrangements(base, n, splits).items() for rate in rates]
    began = time.perf_counter()
    results = list(run_jobs(_one, jobs, processes))
    host_s = time.perf_counter() - began
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for name, n, rate, figures, run_host_s in results:
        entry = by_size.setdefault(n, {}).setdefault(name, {"rates": {}, "host_s": 0.0})
        entry["rates"][f"{rate:g}"] = figures
        entry["host_s"] += run_host_s
    sizes_out = {str(n): _score(arr, n, rates, attainment) for n, arr in by_size.items()}
    return {"sizes": sizes_out, "rates_per_device": rates, "attainment_target": attainment,
            "runs": len(jobs), "host_s": host_s, "processes": process_count(processes, len(jobs))}


def _score(arrangements_: dict[str, dict[str, Any]], n: int, rates: list[float], target: float) -> dict[str, Any]:
    for entry in arrangements_.values():
        points = [(rate * n, entry["rates"][f"{rate:g}"]["slo_attainment"]) for rate in rates]
        entry["knee_req_per_s"] = knee(points, target)
        entry["goodput_per_device"] = entry["knee_req_per_s"] / n
        entry["knee_beyond_rates"] = points[-1][1] >= target  # the knee is at least the top rate swept
    ranked = sorted(arrangements_, key=lambda a: -arrangements_[a]["goodput_per_device"])
    best, second = ranked[0], ranked[1] if len(ranked) > 1 else None
    top, runner_up = (arrangements_[best]["goodput_per_device"],
                      arrangements_[second]["goodput_per_device"] if second else 0.0)
    return {"arrangements": arrangements_, "ranking": ranked, "recommended": best,
            "margin": None if not runner_up else top / runner_up - 1, "next_best": second}


def knee(points: list[tuple[float, float]], target: float) -> float:
    """The highest rate whose attainment is >= target, interpolated linearly up to where the
    attainment crosses it; 0 when even the lowest rate misses."""
    points = sorted(points)
    best = 0.0
    for (r0, a0), (r1, a1) in zip(points, points[1:], strict=False):
        if a0 >= target:
            best = r0
            if a1 < target:
                return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    if points and points[-1][1] >= target:
        best = points[-1][0]
    return best


def format_sweep(result: dict[str, Any]) -> str:
    lines = [f"SLO attainment >= {result['attainment_target']:.0%}; rates are requests/s per device; "
             f"{result['runs']} runs in {result['host_s']:.0f} host s on {result['processes']} processes"]
    for n, size in result["sizes"].items():
        lines.append(f"\n== {n} devices ==  recommended: {size['recommended']}"
                     + (f" (+{size['margin']:.1%} goodput per device over {size['next_best']})"
                        if size["margin"] is not None else ""))
        lines.append(f"{'arrangement':<16}{'goodput/dev':>12}{'knee req/s':>12}  attainment by rate")
        for name in size["ranking"]:
            a = size["arrangements"][name]
            cells = " ".join(f"{v['slo_attainment']:>5.0%}" for v in a["rates"].values())
            at_least = ">=" if a["knee_beyond_rates"] else "  "
            lines.append(f"{name:<16}{at_least}{a['goodput_per_device']:>10.3f}{a['knee_req_per_s']:>12.2f}  {cells}")
    return "\n".join(lines)


def plot_sweep(result: dict[str, Any], path: str) -> str:
    """SLO attainment against rate, a panel per size, a line per arrangement (the best 6 named)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["sizes"].items())
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, (n, size) in zip(axes[0], sizes, strict=True):
        for rank, name in enumerate(size["ranking"]):
            a = size["arrangements"][name]
            xs = [float(r) * int(n) for r in a["rates"]]
            ys = [v["slo_attainment"] for v in a["rates"].values()]
            ax.plot(xs, ys, marker="o", lw=2 if rank < 6 else 0.6, alpha=1 if rank < 6 else 0.35,
                    label=name if rank < 6 else None)
        ax.axhline(result["attainment_target"], color="grey", ls="--", lw=0.8)
        ax.set(title=f"{n} devices", xlabel="requests/s", ylabel="SLO attainment", ylim=(0, 1.02))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
