"""Per-request records to per-level summary statistics, and the results table.

Latency percentiles use linear interpolation between order statistics (numpy's default, as in
vLLM's benchmark). Throughputs divide by the level's wall time, first send to last finish.
Failed requests count in ``errors`` only; they contribute no latencies and no tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from myserve.bench.loadgen import LevelRun

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Stats:
    """Mean and percentiles of one latency, in the unit its field name says; None without data."""

    mean: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: Iterable[float], scale: float = 1.0) -> Stats:
        """The statistics of ``values`` multiplied by ``scale`` (1000 for seconds to ms)."""
        a = np.asarray(list(values), dtype=np.float64) * scale
        if a.size == 0:
            return cls()
        p50, p95, p99 = (float(v) for v in np.percentile(a, PERCENTILES))
        return cls(mean=float(a.mean()), p50=p50, p95=p95, p99=p99)


@dataclass(frozen=True)
class LevelSummary:
    """One concurrency level's results, as written to results.json.

    ``usage_missing``: successes whose server sent no usage (their output tokens are chunk counts).
    ``no_text``: successes that streamed no text at all (no TTFT, ITL or TPOT for them).
    ``error_samples``: the first message of each error kind, to tell why requests failed.
    """

    concurrency: int
    num_requests: int
    requests_ok: int
    requests_failed: int
    errors: dict[str, int]
    wall_s: float
    requests_per_s: float
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_ms: Stats
    itl_ms: Stats
    tpot_ms: Stats
    e2e_s: Stats
    usage_missing: int = 0
    no_text: int = 0
    error_samples: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A plain dict for JSON."""
        return asdict(self)


def summarize(run: LevelRun) -> LevelSummary:
    """The summary of one level's records."""
    ok = [r for r in run.records if r.ok]
    failed = [r for r in run.records if not r.ok]
    samples: dict[str, str] = {}
    for r in failed:
        samples.setdefault(r.error or "", r.error_detail)
    wall = run.wall_s
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    timed = [r for r in ok if r.ttft_s is not None]
    # TPOT needs at least two tokens: the first one's time is TTFT.
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in timed if r.ttft_s is not None and r.output_tokens > 1]
    return LevelSummary(
        concurrency=run.concurrency,
        num_requests=len(run.records),
        requests_ok=len(ok),
        requests_failed=len(failed),
        errors=dict(Counter(r.error or "" for r in failed)),
        wall_s=wall,
        requests_per_s=_rate(len(ok), wall),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        output_tokens_per_s=_rate(output_tokens, wall),
        total_tokens_per_s=_rate(prompt_tokens + output_tokens, wall),
        ttft_ms=Stats.of((r.ttft_s for r in timed if r.ttft_s is not None), 1e3),
        itl_ms=Stats.of((gap for r in ok for gap in r.itl_s), 1e3),
        tpot_ms=Stats.of(tpot, 1e3),
        e2e_s=Stats.of(r.e2e_s for r in ok),
        usage_missing=sum(not r.usage_reported for r in ok),
        no_text=len(ok) - len(timed),
        error_samples=samples,
    )


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


_COLUMNS = (
    ("conc", "concurrency", "{}"),
    ("ok/err", None, ""),
    ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("tot tok/s", "total_tokens_per_s", "{:.1f}"),
    ("req/s", "requests_per_s", "{:.2f}"),
    ("TTFT p50 ms", ("ttft_ms", "p50"), "{:.1f}"),
    ("p95", ("ttft_ms", "p95"), "{:.1f}"),
    ("p99", ("ttft_ms", "p99"), "{:.1f}"),
    ("ITL p50 ms", ("itl_ms", "p50"), "{:.1f}"),
    ("p95", ("itl_ms", "p95"), "{:.1f}"),
    ("TPOT p50 ms", ("tpot_ms", "p50"), "{:.1f}"),
    ("e2e p50 s", ("e2e_s", "p50"), "{:.2f}"),
)


def format_table(results: Sequence[dict[str, Any]], title: str = "") -> str:
    """A fixed-width text table, one row per level; ``results`` are ``LevelSummary.to_json()`` dicts."""
    rows = [[name for name, _, _ in _COLUMNS]]
    for r in results:
        row = []
        for _, key, fmt in _COLUMNS:
            if key is None:
                row.append(f"{r['requests_ok']}/{r['requests_failed']}")
                continue
            value = r[key[0]][key[1]] if isinstance(key, tuple) else r[key]
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(([title] if title else []) + lines)
