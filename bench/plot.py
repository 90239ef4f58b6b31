"""PNG charts of a bench run (matplotlib, Agg backend; imported only with `--plot`).

ttft_cdf.png and itl_cdf.png: one CDF per arrangement. itl_over_time.png: one panel per
arrangement (or server), all on the same axes: every inter-token gap at the time its token
arrived, a rolling p99 line over them, and the workload's burst window shaded, so output
freezes caused by a burst of long prefills show up where they happen. steps_over_time.png (with
step records): every engine step's wall time at the time it ended, one panel per run, decode-only
steps apart from steps that ran prefill chunks. The HTML report embeds the same figures and the
bottleneck shares (`bottleneck_figure`) as PNG bytes (`png_bytes`).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from bench.metrics import RequestRecord, itls, rolling_percentile, token_times, ttft  # noqa: E402

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


def png_bytes(fig: Any) -> bytes:
    """The figure as PNG (for embedding), closed afterwards."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def plot_cdf(path: Path, title: str, series: Mapping[str, np.ndarray]) -> Path:
    return _save(cdf_figure(title, series), path)


def cdf_figure(title: str, series: Mapping[str, np.ndarray]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in series.items():
        _cdf(ax, values, label)
    ax.set(title=title, xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


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


def steps_over_time_figure(steps: Mapping[str, Mapping[str, Any]], burst: Mapping[str, float] | None) -> Any:
    """A panel per run: each step's wall time when it ended, by pool and by whether it ran prefill."""
    fig, axes = plt.subplots(len(steps), 1, sharex=True, sharey=True, squeeze=False,
                             figsize=(9, 1.2 + 2.2 * len(steps)))
    styles = {("decode", False): ("tab:blue", "decode pool: decodes only"),
              ("decode", True): ("tab:orange", "decode pool: with prefill chunks"),
              ("prefill", True): ("tab:gray", "prefill pool")}
    for ax, (name, workers) in zip(axes[:, 0], steps.items(), strict=True):
        for (pool, mixed), (color, label) in styles.items():
            points = [(s["t_s"], s["wall_s"] * 1e3) for w in workers.values() if w["pool"] == pool
                      for s in w["steps"] if (s["prefill_rows"] > 0) == mixed or pool == "prefill"]
            if points:
                t, ms = np.array(points).T
                ax.scatter(t, ms, s=4, alpha=0.4, color=color, label=label)
        if burst:
            ax.axvspan(burst["start_s"], burst["end_s"], color="red", alpha=0.15, label="burst arrives")
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_yscale("log")
        ax.set_ylabel("step (ms)")
        ax.grid(alpha=0.3)
        ax.legend(markerscale=3, fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since run start")
    fig.suptitle("Engine step time over the run")
    return fig


def bottleneck_figure(summaries: Mapping[str, Mapping[str, Any]]) -> Any:
    """Stacked bars per run: what the p99 TTFT tail's time and the p99 ITL tail's gaps were made of."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 2.4 + 0.6 * len(summaries)), squeeze=False)
    for ax, key, title in ((axes[0, 0], "ttft_p99", "TTFT tail (requests >= p95): share of time"),
                           (axes[0, 1], "itl_p99", "ITL tail (gaps >= p95): share of gaps")):
        names = list(summaries)
        found = [(summaries[n].get("bottleneck") or {}).get(key) for n in names]
        parts = next((list(f["shares"]) for f in found if f), [])
        left = np.zeros(len(names))
        for i, part in enumerate(parts):
            widths = np.array([f["shares"][part] if f else 0.0 for f in found])
            ax.barh(names, widths, left=left, color=plt.cm.tab10(i), label=part.replace("_", " "))
            left += widths
        ax.set(title=title, xlim=(0, 1))
        ax.invert_yaxis()
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    return fig


def inspect_figure(result: Mapping[str, Any], input_lens: Sequence[int], output_lens: Sequence[int],
                   title: str) -> Any:
    """`pdserve inspect --plot`: one page — length histograms, arrival rate with its peaks, requests
    in flight (and waiting), KV demand against the capacity."""
    fig = plt.figure(figsize=(10, 12.5))
    grid = fig.add_gridspec(4, 2)
    for col, (lens, name) in enumerate(((input_lens, "input"), (output_lens, "output"))):
        ax = fig.add_subplot(grid[0, col])
        ax.hist(lens, bins=40, color="tab:blue" if col == 0 else "tab:green")
        ax.set(title=f"{name} length (tokens)", ylabel="requests")
    rows, width = result["timeline"], result["bucket_s"]
    t = np.array([r["start_s"] for r in rows])
    ax = fig.add_subplot(grid[1, :])
    colors = ["tab:red" if r["peak"] else "tab:blue" for r in rows]
    ax.bar(t, [r["rate"] for r in rows], width=width, align="edge", color=colors)
    ax.set(title="arrival rate (peaks in red)", ylabel="requests/s")
    ax = fig.add_subplot(grid[2, :], sharex=fig.axes[-1])
    ax.step(t, [r["in_flight_mean"] for r in rows], where="post", label="in flight (mean)")
    ax.step(t, [r["in_flight_max"] for r in rows], where="post", label="in flight (max)", alpha=0.6)
    if rows and rows[0]["waiting_mean"] is not None:
        ax.step(t, [r["waiting_mean"] for r in rows], where="post", label="waiting in the router (mean)")
    ax.set(title="concurrency" + (" (estimated durations)" if result["estimate"] else ""), ylabel="requests")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(grid[3, :], sharex=fig.axes[-1])
    kv = result["kv"]
    ax.step(t, [r["kv_bytes_max"] / 2**30 for r in rows], where="post", label="KV held (max per bucket)")
    ax.axhline(kv["capacity_bytes"] / 2**30, color="tab:red", linestyle="--", label="capacity")
    ax.set(title=f"KV demand, {kv['model']} {kv['dtype']}", ylabel="GiB", xlabel="seconds")
    ax.legend(fontsize=8)
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return fig


def latency_series(records: Mapping[str, Sequence[RequestRecord]]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(TTFT ms per run, pooled ITL ms per run)."""
    ttfts = {name: np.array([ttft(r) * 1000 for r in runs if r.ok]) for name, runs in records.items()}
    itl_ms = {name: np.concatenate([itls(r) for r in runs if r.ok] or [np.array([])]) * 1000
              for name, runs in records.items()}
    return ttfts, itl_ms


def write_plots(out_dir: Path, records: Mapping[str, Sequence[RequestRecord]],
                burst: Mapping[str, float] | None,
                steps: Mapping[str, Mapping[str, Any]] | None = None) -> list[Path]:
    """Writes the charts into `out_dir` (steps_over_time.png only with step records); returns their paths."""
    ttfts, itl_ms = latency_series(records)
    written = [
        plot_cdf(out_dir / "ttft_cdf.png", "Time to first token (CDF)", ttfts),
        plot_cdf(out_dir / "itl_cdf.png", "Inter-token latency (CDF, pooled)", itl_ms),
        plot_itl_over_time(out_dir / "itl_over_time.png", records, burst),
    ]
    if steps:
        written.append(_save(steps_over_time_figure(steps, burst), out_dir / "steps_over_time.png"))
    return written
