"""PNG charts of a bench run (matplotlib, Agg backend; imported only with `--plot`).

ttft_cdf.png and itl_cdf.png: one CDF per arrangement. itl_over_time.png: every
inter-token gap at the time its token arrived, with the workload's burst window shaded,
so output freezes caused by a burst of long prefills show up where they happen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from router.bench.metrics import RequestRecord, itls, token_times, ttft  # noqa: E402


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


def plot_itl_over_time(path: Path, records: Mapping[str, Sequence[RequestRecord]],
                       burst: Mapping[str, float] | None) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, runs in records.items():
        done = [r for r in runs if r.ok and r.output_tokens > 1]
        times = np.concatenate([token_times(r)[1:] for r in done]) if done else np.array([])
        gaps = np.concatenate([itls(r) for r in done]) * 1000 if done else np.array([])
        ax.scatter(times, gaps, s=4, alpha=0.5, label=name)
    if burst:
        ax.axvspan(burst["start_s"], burst["end_s"], color="red", alpha=0.15,
                   label="burst of long prompts arrives")
    ax.set(title="Inter-token latency over the run", xlabel="seconds since run start",
           ylabel="ITL (ms)")
    ax.grid(alpha=0.3)
    ax.legend(markerscale=3)
    return _save(fig, path)


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
