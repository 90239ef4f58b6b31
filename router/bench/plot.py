"""PNG charts of a bench run (matplotlib, Agg backend; imported only with `--plot`).

ttft_cdf.png and itl_cdf.png: one CDF per arrangement. itl_over_time.png: one panel per
arrangement (or server), all on the same axes: every inter-token gap at the time its token
arrived, a rolling p99 line over them, and the workload's burst window shaded, so output
freezes caused by a burst of long prefills show up where they happen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from router.bench.metrics import RequestRecord, itls, rolling_percentile, token_times, ttft  # noqa: E402

ROLLING_WINDOWS = 40  # the rolling p99's window: this fraction of the run (at least MIN_WINDOW_S)
MIN_WINDOW_S = 0.25


def _cdf(ax: Any, values_ms: np.ndarray, label: str) -> None:
    if values_ms.size:
        ordered = np.sort(values_ms)
        ax.plot(ordered, np.arange(1, ordered.size + 1) / ordered.size, label=label)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_cdf(path: Path, title: str, series: Mapping[str, np.ndarray]) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in series.items():
        _cdf(ax, values, label)
    ax.set(title=title, xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _gaps(runs: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(arrival time of each token after a request's first, its gap in ms), pooled over requests."""
    done = [r for r in runs if r.ok and r.output_tokens > 1]
    if not done:
        return np.array([]), np.array([])
    return np.concatenate([token_times(r)[1:] for r in done]), np.concatenate([itls(r) for r in done]) * 1000


def itl_over_time_figure(records: Mapping[str, Sequence[RequestRecord]],
                         burst: Mapping[str, float] | None) -> Any:
    """A panel per arrangement sharing both axes: gaps, their rolling p99, the burst window."""
    series = {name: _gaps(runs) for name, runs in records.items()}
    span = max((t.max() for t, _ in series.values() if t.size), default=0.0)
    window_s = max(span / ROLLING_WINDOWS, MIN_WINDOW_S)
    fig, axes = plt.subplots(len(series), 1, sharex=True, sharey=True, squeeze=False,
                             figsize=(9, 1.2 + 2.2 * len(series)))
    for ax, (name, (times, gaps)) in zip(axes[:, 0], series.items(), strict=True):
        ax.scatter(times, gaps, s=4, alpha=0.35, color="tab:blue", label="inter-token gap")
        grid, p99 = rolling_percentile(times, gaps, window_s)
        ax.plot(grid, p99, color="black", linewidth=1.2, label=f"rolling p99 ({window_s:.2g} s window)")
        if burst:
            ax.axvspan(burst["start_s"], burst["end_s"], color="red", alpha=0.15,
                       label="burst of long prompts arrives")
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_yscale("symlog", linthresh=1.0)  # ms to tens of seconds in one view; 0 (a merged token) stays
        ax.set_ylabel("ITL (ms)")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(markerscale=3, fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since run start")
    fig.suptitle("Inter-token latency over the run")
    return fig


def plot_itl_over_time(path: Path, records: Mapping[str, Sequence[RequestRecord]],
                       burst: Mapping[str, float] | None) -> Path:
    return _save(itl_over_time_figure(records, burst), path)


def write_plots(out_dir: Path, records: Mapping[str, Sequence[RequestRecord]],
                burst: Mapping[str, float] | None) -> list[Path]:
    """Writes the three charts into `out_dir`; returns their paths."""
    ttfts = {name: np.array([ttft(r) * 1000 for r in runs if r.ok]) for name, runs in records.items()}
    itl_ms = {name: np.concatenate([itls(r) for r in runs if r.ok] or [np.array([])]) * 1000
              for name, runs in records.items()}
    return [
        plot_cdf(out_dir / "ttft_cdf.png", "Time to first token (CDF)", ttfts),
        plot_cdf(out_dir / "itl_cdf.png", "Inter-token latency (CDF, pooled)", itl_ms),
        plot_itl_over_time(out_dir / "itl_over_time.png", records, burst),
    ]
