"""`tokenmill bench serve --plot out.png`: one figure of a serving benchmark.

Three panels: the TTFT distribution and the ITL distribution (histogram with the empirical CDF
over it, p50/p99 marked), and throughput over time (output tokens/s and requests in flight, in
bins of the run's length / 40) — what tells a steady run from one that stalled or warmed up late.
matplotlib is an optional dependency (the `plot` extra); the Agg backend needs no display.
"""
from __future__ import annotations

from typing import Any, Sequence


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'tokenmill[plot]'") from None


def token_times(results: Sequence[Any], t0: float) -> list[float]:
    """When each streamed chunk of every successful request arrived, in seconds since t0."""
    times = []
    for r in results:
        if not r.ok:
            continue
        t = r.start - t0 + r.ttft
        times.append(t)
        for gap in r.itl:
            t += gap
            times.append(t)
    return times


def _distribution(ax: Any, values_ms: list[float], title: str, color: str) -> None:
    import numpy as np
    ax.set_title(title)
    ax.set_xlabel("ms")
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    a = np.sort(np.asarray(values_ms))
    ax.hist(a, bins=min(50, max(5, len(a) // 4)), color=color, alpha=0.6)
    ax.set_ylabel("requests" if "TTFT" in title else "tokens")
    cdf = ax.twinx()
    cdf.plot(a, np.arange(1, len(a) + 1) / len(a), color="black", linewidth=1.2)
    cdf.set_ylim(0, 1.02)
    cdf.set_ylabel("CDF")
    for q, style in ((50, "--"), (99, ":")):
        v = float(np.percentile(a, q))
        ax.axvline(v, color="black", linestyle=style, linewidth=1)
        ax.text(v, ax.get_ylim()[1] * 0.95, f" p{q} {v:.1f}", fontsize=8, va="top")


def plot_results(results: Sequence[Any], summary: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.ok]
    t0 = min((r.start for r in results), default=0.0)
    fig, (ax_ttft, ax_itl, ax_tp) = plt.subplots(1, 3, figsize=(15, 4.5))
    fig.suptitle(f"tokenmill bench serve — {summary.get('workload', '')}; {summary.get('completed', 0)} ok, "
                 f"{summary.get('failed', 0)} failed, {summary.get('output_throughput', 0.0):.1f} output tok/s")
    _distribution(ax_ttft, [r.ttft * 1000 for r in ok], "TTFT", "tab:blue")
    _distribution(ax_itl, [x * 1000 for r in ok for x in r.itl], "ITL", "tab:orange")

    ax_tp.set_title("throughput over time")
    ax_tp.set_xlabel("s since the first request")
    times = token_times(ok, t0)
    end = max([r.start - t0 + r.latency for r in ok] + times + [1e-3])
    bin_s = max(end / 40, 1e-3)
    edges = np.arange(0, end + bin_s, bin_s)
    counts, _ = np.histogram(times, bins=edges)
    # each chunk is one token for the usual streaming server; scale to the usage-reported token count
    chunks = max(len(times), 1)
    scale = sum(r.output_tokens for r in ok) / chunks if times else 0.0
    ax_tp.step(edges[:-1], counts * scale / bin_s, where="post", color="tab:green", label="output tokens/s")
    ax_tp.set_ylabel("output tokens/s")
    inflight = ax_tp.twinx()
    mids = edges[:-1] + bin_s / 2
    running = [sum(1 for r in ok if r.start - t0 <= m < r.start - t0 + r.latency) for m in mids]
    inflight.plot(mids, running, color="tab:purple", linewidth=1, label="requests in flight")
    inflight.set_ylabel("requests in flight")
    inflight.set_ylim(bottom=0)
    ax_tp.set_ylim(bottom=0)
    lines = ax_tp.get_legend_handles_labels()[0] + inflight.get_legend_handles_labels()[0]
    ax_tp.legend(lines, [line.get_label() for line in lines], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
