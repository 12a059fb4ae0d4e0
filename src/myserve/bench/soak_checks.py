"""The soak benchmark's bookkeeping, without a server: outcomes of requests, process memory, the
Prometheus figures it reads, the pass/fail checks and the summary table (``bench/soak.py`` runs it).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from collections.abc import Mapping

OK, DISCONNECTED, OVERLOADED = "ok", "disconnected", "429"
"""Expected outcomes: completed, hung up on by the client on purpose, refused with a full queue."""
FAILURES = ("5xx", "4xx", "stream_error", "incomplete", "bad_output", "timeout", "transport")
"""Failed outcomes: HTTP 5xx, any other 4xx, an error event in a stream, a stream that ended early,
output that breaks its grammar (or is not the API's shape), no answer in time, a broken connection."""
OUTCOMES = (OK, DISCONNECTED, OVERLOADED, *FAILURES)

IDLE_GAUGES = {
    "vllm:num_requests_running": "requests running",
    "vllm:num_requests_waiting": "requests waiting",
    "myserve_kv_pages_used": "KV pages held by a sequence",
    "myserve_grammar_matchers_active": "grammar matchers alive",
    "myserve_penalty_slots_used": "penalty slots owned",
}
"""Engine gauges that must read 0 once the server is idle. ``myserve_kv_pages_used`` counts pages
with a reference (``PageAllocator.num_used``); pages the prefix cache keeps with no reference are
evictable, so they count as free: an idle server holds none however much it has cached."""

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


_MODEL_LABEL = re.compile(r',?model_name="(?:[^"\\]|\\.)*"')
"""The ``model_name`` label every myserve series carries, which the figures leave out."""


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition text as ``{"name" or "name{labels}": value}`` (comments skipped), the
    ``model_name`` label left out: a server of several models has each figure summed over them."""
    figures: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            try:
                value = float(match.group(2))
            except ValueError:
                continue
            name = _MODEL_LABEL.sub("", match.group(1)).replace("{,", "{").replace("{}", "")
            figures[name] = figures.get(name, 0.0) + value
    return figures


def rss_kb(pid: int) -> int | None:
    """Resident memory of ``pid`` (``VmRSS`` of ``/proc/<pid>/status``), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def core_pid(front_pid: int) -> int | None:
    """The engine core: the child of the front end that multiprocessing spawned (``spawn_main``;
    the resource tracker, another child, is not one)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == front_pid and b"spawn_main" in cmdline:
            return int(entry)
    return None


@dataclasses.dataclass
class Tally:
    """Requests by scenario and outcome, generated tokens, and a sample message per failure."""

    counts: collections.Counter[tuple[str, str]] = dataclasses.field(default_factory=collections.Counter)
    completion_tokens: int = 0
    samples: dict[str, str] = dataclasses.field(default_factory=dict)
    missing_retry_after: int = 0
    other_5xx: int = 0
    """5xx answers to probes (``/health``, ``/metrics``), not to generation requests."""

    def add(self, scenario: str, outcome: str, detail: str = "", tokens: int = 0) -> None:
        """Count one request."""
        self.counts[scenario, outcome] += 1
        self.completion_tokens += tokens
        if outcome in FAILURES:
            self.samples.setdefault(f"{scenario}/{outcome}", detail[:300])

    def total(self, outcome: str) -> int:
        """Requests of every scenario that ended with ``outcome``."""
        return sum(n for (_, o), n in self.counts.items() if o == outcome)


@dataclasses.dataclass(frozen=True)
class Check:
    """One pass/fail figure of the soak."""

    name: str
    ok: bool
    detail: str


def evaluate(
    tally: Tally,
    idle: Mapping[str, float] | None,
    healthy: bool,
    health_detail: str,
    rss: Mapping[str, tuple[int | None, int | None]],
    tolerance: float,
    bursts: bool,
) -> list[Check]:
    """Every check of the soak. ``idle``: the metrics once idle (None: unreadable); ``rss``: process
    name -> (kB at the baseline, kB at the end); growth above ``tolerance`` (0.05 = 5 %) fails."""
    checks = []
    for name, label in IDLE_GAUGES.items():
        value = None if idle is None else idle.get(name)
        detail = "not reported" if value is None else f"{value:g}"
        checks.append(Check(f"idle: {label} = 0", value == 0, detail))
    fives = tally.total("5xx") + tally.other_5xx
    checks.append(Check("no 5xx at any time", fives == 0, f"{fives} seen"))
    failed = {o: tally.total(o) for o in FAILURES if o != "5xx" and tally.total(o)}
    detail = ", ".join(f"{o} x{n}" for o, n in failed.items()) or "none"
    checks.append(Check("no other failed request", not failed, detail))
    overloaded = tally.total(OVERLOADED)
    if bursts:
        checks.append(Check("bursts went over the queue limit (429)", overloaded > 0, f"{overloaded} x 429"))
    checks.append(Check("every 429 had Retry-After", tally.missing_retry_after == 0, f"{tally.missing_retry_after}"))
    checks.append(Check("server healthy at the end", healthy, health_detail))
    for process, (base, end) in rss.items():
        if base is None or end is None:
            checks.append(Check(f"{process} RSS within {tolerance:.0%}", False, "not measured"))
            continue
        growth = end / base - 1
        checks.append(Check(f"{process} RSS within {tolerance:.0%}", growth <= tolerance, f"{growth:+.1%}"))
    return checks


def format_summary(
    tally: Tally,
    seconds: float,
    rss: Mapping[str, tuple[int | None, int | None, int | None]],
    idle: Mapping[str, float] | None,
    peaks: Mapping[str, float],
    checks: list[Check],
) -> str:
    """The final report: requests by scenario and outcome, tokens/s, RSS, idle gauges, checks.
    ``rss``: process -> (kB at the baseline, peak, at the end)."""
    scenarios = sorted({s for s, _ in tally.counts})
    columns = [o for o in OUTCOMES if tally.total(o)] or [OK]
    width = max([len(s) for s in scenarios] + [8])
    lines = [f"{'scenario':<{width}} " + " ".join(f"{c:>12}" for c in columns) + f" {'total':>7}"]
    for s in [*scenarios, "all"]:
        row = [tally.total(c) if s == "all" else tally.counts[s, c] for c in columns]
        lines.append(f"{s:<{width}} " + " ".join(f"{n:>12}" for n in row) + f" {sum(row):>7}")
    rate = tally.completion_tokens / seconds if seconds > 0 else 0.0
    lines.append(f"\ngenerated {tally.completion_tokens} tokens in {seconds:.0f} s of traffic: {rate:.1f} tokens/s")

    def mb(kb: int | None) -> str:
        return "-" if kb is None else f"{kb / 1024:.1f} MiB"

    lines.append(f"\n{'process':<10} {'RSS at baseline':>16} {'peak':>12} {'at end':>12} {'change':>8}")
    for process, (base, peak, end) in rss.items():
        change = f"{end / base - 1:+.1%}" if base and end else "-"
        lines.append(f"{process:<10} {mb(base):>16} {mb(peak):>12} {mb(end):>12} {change:>8}")
    lines.append(f"\n{'gauge':<34} {'peak':>8} {'idle':>8}")
    for name in [*IDLE_GAUGES, "myserve_kv_pages_total"]:
        value = "-" if idle is None or name not in idle else f"{idle[name]:g}"
        lines.append(f"{name:<34} {peaks.get(name, 0):>8g} {value:>8}")
    lines.append("(pages the prefix cache keeps with no reference count as free, not as used)")
    for key, sample in tally.samples.items():
        lines.append(f"\nfirst {key}: {sample}")
    lines.append("")
    lines += [f"{'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}" for c in checks]
    return "\n".join(lines)
