"""The planner's run as a picture: the arrival rate over time, and per pool the workers it
wanted (each decision's desired count) against the workers alive (starting, serving, draining).

Decisions are the planner's `Decision` records as dicts (router/autoscale/observation.py):
`at` (seconds from the first arrival) and `pools: {POOL: {"desired": N, "actual": N, ...}}`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def arrival_rate(arrivals_s: Sequence[float], bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin starts, requests/s in each bin)."""
    if not arrivals_s:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, max(arrivals_s) + 2 * bin_s, bin_s)  # the last arrival inside the last bin
    counts, _ = np.histogram(arrivals_s, bins=edges)
    return edges[:-1], counts / bin_s


def desired(decision: Mapping[str, Any], pool: str) -> int | None:
    entry = decision["pools"].get(pool)
    return None if entry is None else entry["desired"]


def plot_timeline(timeline: Mapping[str, Any], arrivals_s: Sequence[float], path: str, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = [p for p in ("prefill", "decode") if p in timeline["actual"]]
    fig, axes = plt.subplots(1 + len(pools), 1, figsize=(10, 2.4 * (1 + len(pools))), sharex=True)
    span = max(arrivals_s) if arrivals_s else 1.0
    xs, rate = arrival_rate(arrivals_s, max(1.0, span / 120))
    axes[0].step(xs, rate, where="post", color="black")
    axes[0].set(ylabel="arrivals (req/s)", title=title or "the planner: desired vs actual workers")
    for ax, pool in zip(axes[1:], pools, strict=True):
        actual = timeline["actual"][pool]
        ax.step([t for t, _ in actual], [n for _, n in actual], where="post", label=f"{pool}: alive", lw=2)
        points = [(d["at"], desired(d, pool)) for d in timeline["decisions"] if desired(d, pool) is not None]
        if points:
            ax.step([t for t, _ in points], [n for _, n in points], where="post", ls="--", label=f"{pool}: desired")
        ax.set(ylabel="workers")
        ax.legend(fontsize=8, loc="upper left")
    axes[-1].set(xlabel="simulated seconds from the first arrival")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
