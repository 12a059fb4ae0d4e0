"""Figures from results.json files: throughput, TTFT and ITL against concurrency.

One file plots one server; several files plot side by side, one line per file (its ``label``).
matplotlib comes with the ``bench`` extra and is imported only here, through its object API with
the Agg canvas, so no display and no global pyplot state are involved.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (subplot title, y label, [(results field, statistic or None, line style)])
_PANELS: tuple[tuple[str, str, tuple[tuple[str, str | None, str], ...]], ...] = (
    ("Output throughput", "output tokens/s", (("output_tokens_per_s", None, "-"),)),
    ("Time to first token", "TTFT ms (solid p50, dashed p99)", (("ttft_ms", "p50", "-"), ("ttft_ms", "p99", "--"))),
    ("Inter-token latency", "ITL ms (solid p50, dashed p95)", (("itl_ms", "p50", "-"), ("itl_ms", "p95", "--"))),
)


def load_results(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The results.json objects at ``paths``, checked to hold a ``results`` list."""
    loaded = []
    for path in paths:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(obj, dict) or not isinstance(obj.get("results"), list):
            raise ValueError(f"{path}: not a myserve.bench results file (no 'results' list)")
        obj.setdefault("label", Path(path).stem)
        loaded.append(obj)
    return loaded


def plot_results(runs: Sequence[dict[str, Any]], output: str | Path, title: str | None = None) -> Path:
    """Write a PNG (or any format matplotlib knows from the suffix) comparing ``runs``; returns its path."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError('plotting needs matplotlib: pip install -e ".[bench]" (or pip install matplotlib)') from e

    fig = Figure(figsize=(5.0 * len(_PANELS), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(_PANELS))
    levels = sorted({r["concurrency"] for run in runs for r in run["results"]})
    for ax, (panel_title, ylabel, series) in zip(axes, _PANELS, strict=True):
        for i, run in enumerate(runs):
            color = f"C{i}"
            rows = sorted(run["results"], key=lambda r: r["concurrency"])
            for key, stat, style in series:
                points = [(r["concurrency"], _value(r, key, stat)) for r in rows]
                xs = [x for x, y in points if y is not None]
                ys = [y for _, y in points if y is not None]
                # One legend entry per server: the solid line; the dashed one shares its colour.
                label = run["label"] if style == "-" else None
                ax.plot(xs, ys, style, marker="o", color=color, label=label)
        if len(levels) > 1 and min(levels) > 0:
            ax.set_xscale("log", base=2)  # concurrency sweeps are usually powers of two
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title or _default_title(runs))
    output = Path(output)
    fig.savefig(output, dpi=110)
    return output


def _value(row: dict[str, Any], key: str, stat: str | None) -> float | None:
    value = row.get(key)
    if stat is not None:
        value = value.get(stat) if isinstance(value, dict) else None
    return float(value) if isinstance(value, int | float) else None


def _default_title(runs: Sequence[dict[str, Any]]) -> str:
    first = runs[0] if runs else {}
    settings = first.get("settings", {})
    return f"{first.get('endpoint', '')} endpoint, max_tokens={settings.get('max_tokens', '?')}".strip()
