"""Stop strings, matched on the detokenized text of one sequence, on the host.

A stop string can span several tokens, so it is matched on text, not ids, and streaming must hold back
the tail of the text that could still grow into a stop string: the client must never see the first
half of a stop string. Only the longest suffix that is a proper prefix of some stop string is held, and
it is released as soon as it can no longer match, so streaming stalls no longer than it has to.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Cuts one sequence's text at the first stop string, streaming everything before it.

    When several stop strings occur, the one that is *completed* first wins (generation would have
    stopped right there), and among those completed by the same character the one that starts first.
    So the output does not depend on how the text was split into deltas. The stop string itself and
    anything after it are dropped (OpenAI's behaviour); with ``include`` the stop string is kept and
    only what follows it is dropped (vLLM's ``include_stop_str_in_output``).
    """

    def __init__(self, stop: Sequence[str] = (), include: bool = False) -> None:
        # An empty stop string would match before any text; OpenAI-compatible servers ignore it.
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        """The stop strings, deduplicated, empty ones dropped."""
        self.matched: str | None = None
        """The stop string that ended the sequence (vLLM's ``stop_reason``), or None."""
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self._include = include

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen; later deltas are then ignored."""
        return self.matched is not None

    @property
    def held(self) -> str:
        """Text received but not yet returned, because it may be the start of a stop string."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Take the next text delta; return ``(text safe to emit now, stopped)``.

        On a stop, the text returned is everything up to the stop string and the checker is done:
        later calls return ``("", True)``.
        """
        if self.matched is not None:
            return "", True
        if not self.stop:
            return delta, False
        # A match cannot start in text already returned: that text was never a possible stop prefix.
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, self.matched = match
            self._held = ""
            return text[: start + len(self.matched) if self._include else start], True
        cut = len(text) - self._hold_length(text)
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """Release the held-back text when the sequence ends for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """``(start, stop string)`` of the match that ends first, ties going to the earlier start."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            # the first occurrence of s is also the first to end, since all occurrences have len(s)
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._max_held), 0, -1):
            tail = text[-length:]
            if any(len(s) > length and s.startswith(tail) for s in self.stop):
                return length
        return 0
