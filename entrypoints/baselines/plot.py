"""`--plot out.png`: the workloads side by side, one column each, output and total tok/s of every
engine and variant the run measured (matplotlib, an optional dependency: `pip install 'tokenmill[bench]'`)."""
from __future__ import annotations

from typing import Any, Optional

COLORS = {"tokenmill": "#1f77b4", "variant": "#9ecae1", "baseline": "#ff7f0e", "hf": "#bbbbbb"}


def series(entry: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, color key, numbers with output_tok_s and maybe total_tok_s) for one workload's entry."""
    out = [("tokenmill", "tokenmill", entry["tokenmill"])]
    if "tokenmill_no_prefix_caching" in entry:
        out.append(("tokenmill\nno prefix cache", "variant", entry["tokenmill_no_prefix_caching"]))
    if "tokenmill_structured" in entry:
        out.append((f"tokenmill\n{entry['structured']['kind']}", "variant", entry["tokenmill_structured"]))
    if "hf" in entry:
        out.append(("transformers\nstatic batch", "hf", entry["hf"]["static_batch"]))
    b = entry.get("baseline")
    if b and "output_tok_s" in b:
        out.append((b["engine"].replace(" (", "\n("), "baseline", b))
    return out


def plot_results(results: dict[str, Any], path: str) -> Optional[str]:
    """Writes the PNG; returns None, or why nothing was written (matplotlib missing)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return ("--plot skipped: matplotlib is not installed in this interpreter "
                "(pip install 'tokenmill[bench]' or pip install matplotlib)")
    workloads = results["workloads"]
    n = max(1, len(workloads))
    fig = Figure(figsize=(3.4 * n + 0.6, 6.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, n, squeeze=False)
    for col, (name, entry) in enumerate(workloads.items()):
        bars = series(entry)
        title = name
        b = entry.get("baseline")
        if b and "ratio_output_tok_s" in b:
            title += f"  (tokenmill / baseline {b['ratio_output_tok_s']:.2f}x)"
        elif b and "error" in b:
            title += "  (baseline failed)"
        for row, metric in enumerate(("output_tok_s", "total_tok_s")):
            ax = axes[row][col]
            labels = [label for label, _, _ in bars]
            values = [nums.get(metric) or 0.0 for _, _, nums in bars]
            rects = ax.bar(range(len(bars)), values, color=[COLORS[c] for _, c, _ in bars])
            ax.bar_label(rects, labels=[f"{v:.1f}" if v else "n/a" for v in values], fontsize=8)
            ax.set_xticks(range(len(bars)), labels, fontsize=7)
            ax.set_ylabel(metric.replace("_tok_s", " tok/s"))
            ax.margins(y=0.15)
            if row == 0:
                ax.set_title(title, fontsize=9)
    fig.suptitle(results.get("engine", "tokenmill"), fontsize=8)
    fig.savefig(path, dpi=110)
    return None
