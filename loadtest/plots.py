"""PNG plots of benchmark results (matplotlib), one function per figure.

Figures are built with ``matplotlib.figure.Figure`` directly, never through ``pyplot``: no
global state, no GUI backend, safe to call from any thread or test. Every function takes
:class:`~loadtest.results.Contender` s and a path, writes one PNG and returns the path.
Time series are bucketed into windows of ``window`` seconds (default: ~30 over the run).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from loadtest.results import Contender

_DPI = 110


def _window(contenders: Sequence[Contender], window: float | None) -> float:
    if window:
        return window
    return max(0.1, max((c.duration for c in contenders), default=0.0) / 30)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    return path


def ttft_cdf(contenders: Sequence[Contender], path: str | Path) -> Path:
    """The distribution of time to first token, one curve per contender (log time axis)."""
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for contender in contenders:
        ttfts = contender.ttfts()
        if ttfts:
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step([t * 1000 for t in ttfts], ys, where="post", label=contender.name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("TTFT CDF")
    return _save(fig, path)


def hit_ratio_over_time(
    contenders: Sequence[Contender], path: str | Path, window: float | None = None
) -> Path:
    """Engine-reported cached / prompt tokens of the requests sent in each window."""
    width = _window(contenders, window)
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for contender in contenders:
        prompt: dict[int, int] = defaultdict(int)
        cached: dict[int, int] = defaultdict(int)
        for r in contender.ok:
            bucket = int(r.t // width)
            prompt[bucket] += r.prompt_tokens
            cached[bucket] += r.cached_tokens
        buckets = sorted(b for b in prompt if prompt[b])
        ax.plot([b * width for b in buckets], [cached[b] / prompt[b] for b in buckets], label=contender.name)
    ax.set_xlabel(f"time (s, windows of {width:.3g} s)")
    ax.set_ylabel("prefix cache hit ratio")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Hit ratio over time")
    return _save(fig, path)


def _panels(count: int, title: str) -> tuple[Figure, list]:
    fig = Figure(figsize=(7, 2.4 * count + 0.6))
    axes = [fig.add_subplot(count, 1, i + 1) for i in range(count)]
    fig.suptitle(title)
    return fig, axes


def backend_share_over_time(
    contenders: Sequence[Contender], path: str | Path, window: float | None = None
) -> Path:
    """Per contender, the fraction of each window's requests that went to each backend (stacked)."""
    width = _window(contenders, window)
    fig, axes = _panels(len(contenders), "Per-backend request share over time")
    for ax, contender in zip(axes, contenders, strict=True):
        counts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for r in contender.ok:
            counts[int(r.t // width)][r.backend or "?"] += 1
        buckets = sorted(counts)
        backends = sorted({b for per in counts.values() for b in per})
        if buckets:
            shares = [[counts[k][b] / sum(counts[k].values()) for k in buckets] for b in backends]
            ax.stackplot([k * width for k in buckets], shares, labels=backends, step="post")
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        ax.set_ylim(0, 1)
        ax.set_ylabel("share")
        ax.set_title(contender.name, fontsize="medium")
    axes[-1].set_xlabel(f"time (s, windows of {width:.3g} s)")
    return _save(fig, path)


def queue_depth_over_time(contenders: Sequence[Contender], path: str | Path) -> Path:
    """Per contender, each backend's sampled queue depth over time."""
    fig, axes = _panels(len(contenders), "Queue depth per backend over time")
    for ax, contender in zip(axes, contenders, strict=True):
        series: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for sample in contender.queue:
            series[sample.backend].append((sample.t, sample.depth))
        for backend, points in sorted(series.items()):
            points.sort()
            ax.plot([t for t, _ in points], [d for _, d in points], label=backend)
        if series:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        ax.set_ylabel("waiting")
        ax.set_title(contender.name, fontsize="medium")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("time (s)")
    return _save(fig, path)
