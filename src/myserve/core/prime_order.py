"""The order the idle engine primes a replica's executables in (``ModelRunner.prime_next``): each
run once on an empty batch before a request needs it (``runtime/priming.py``)."""

from __future__ import annotations

from myserve.runtime.step_ops import CompileSteps, PrimeSteps


def prime_order(now: CompileSteps) -> list[PrimeSteps]:
    """The executables built before ready, one ``PrimeSteps`` each, in the order the idle engine
    primes them: the small ones first (the heads, then the forwards from the fewest tokens up),
    so that a request arriving meanwhile waits behind a short prime; the prompt scorers, which
    few requests use, last."""
    units = PrimeSteps(now).units()
    return [
        *(u for u in units if u.steps.heads),
        *(u for u in units if u.steps.shapes or u.steps.images),
        *(u for u in units if u.steps.scores),
    ]


def unit_width(unit: PrimeSteps) -> int:
    """The context bucket of a background build's ``PrimeSteps`` (its one forward or decode call):
    the background builds are primed narrowest first."""
    steps = unit.steps
    return steps.shapes[0].width if steps.shapes else steps.loops[0][0].width
