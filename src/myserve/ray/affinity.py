"""Which replica a request goes to: the one whose prefix cache holds the longest start of the
request's text, unless that replica is much busier than the least loaded one; otherwise (and for
``ray.routing: least_loaded``) the least loaded.

This is host logic without Ray: ``ray/router.py`` calls it from Ray Serve's request router. A
replica is taken to hold what it was last sent: the request's text (model name, then each message's
role and content, or the prompt) is cut into ``BLOCK_CHARS``-character blocks, and each replica
keeps the chained hashes of the blocks of the requests it got (bounded, least recently used first
out). A request's match with a replica is the number of its leading blocks that replica holds.
Characters stand in for tokens: the ingress never tokenizes, and a shared text start is a shared
token start for every tokenizer we serve (a block boundary inside a token only costs that block).
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

BLOCK_CHARS = 128
"""Characters per hashed block: about 32 tokens of English, two of the KV cache's 16-token pages."""
MAX_TEXT_CHARS = 64 * 1024
"""Only a request's start is looked at: beyond it, a longer match changes no decision."""
MAX_BLOCKS_PER_REPLICA = 200_000
"""Block hashes remembered per replica (about 25 MB of text's worth): the oldest are dropped."""

ROUTERS: dict[str, Any] = {}
"""The request routers of this process by Ray Serve application name (``ray/router.py`` registers
each as its handle creates it; the ingress lists their replicas to reach each one)."""
ASSIGNED: dict[str, str] = {}
"""Which replica (its unique id) each request in flight was sent to, by ``RouteHint.request``: the
router files it, the ingress watches that replica is still alive and drops the entry at the end."""


@dataclasses.dataclass(frozen=True)
class RouteHint:
    """What the ingress tells the router about a request: the first argument of each call it makes
    to the engine replicas."""

    text: str | None = None
    """The request's ``routing_text`` (None: nothing to match, so the least loaded replica)."""
    replica: str | None = None
    """Only this replica (its unique id): a call made to each replica in turn, as ``/metrics``."""
    request: str | None = None
    """The request's id, under which the router files the replica it chose (``ASSIGNED``)."""


def routing_text(path: str, body: bytes) -> str | None:
    """The text a request's prefix-cache entry would start with, or None (no body, not JSON, or a
    route without a prompt): the model, then the messages (chat, Responses) or the prompt
    (completions, embeddings)."""
    if not body:
        return None
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    parts = [str(request.get("model", ""))]
    if path.endswith("/chat/completions") or path.endswith("/responses"):
        parts.append(_text(request.get("instructions")))
        parts.extend(_message(m) for m in _items(request.get("messages", request.get("input"))))
    else:
        parts.append(_text(request.get("prompt", request.get("input"))))
    text = "\x1e".join(parts)
    return text[:MAX_TEXT_CHARS] if len(parts) > 1 and len(text) > len(parts[0]) + 1 else None


def _items(value: object) -> list[object]:
    if isinstance(value, list):
        return value
    return [] if value is None else [value]


def _message(message: object) -> str:
    if isinstance(message, dict):
        return f"{message.get('role', '')}\x1f{_text(message.get('content'))}"
    return _text(message)


def _text(value: object) -> str:
    """A content value as text: a string, a list of parts (their text), token ids, or nothing."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\x1d".join(_text(v.get("text") if isinstance(v, dict) else v) for v in value)
    return str(value)


def block_hashes(text: str) -> list[int]:
    """The chained hashes of ``text``'s whole ``BLOCK_CHARS`` blocks: the i-th names blocks 0..i."""
    hashes, previous = [], 0
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        previous = hash((previous, text[start : start + BLOCK_CHARS]))
        hashes.append(previous)
    return hashes


class PrefixAffinity:
    """Ranks replicas for a request (prefix holder first, else least loaded), and remembers which
    replica was sent which text. One per router, used from one event loop."""

    def __init__(self, imbalance: int = 8, *, use_prefix: bool = True, max_blocks: int = MAX_BLOCKS_PER_REPLICA):
        self.imbalance = imbalance
        self.use_prefix = use_prefix
        self.max_blocks = max_blocks
        self._held: dict[str, OrderedDict[int, None]] = {}
        self._in_flight: dict[str, int] = {}

    def rank(
        self, text: str | None, replicas: Sequence[str], loads: Mapping[str, int] | None = None
    ) -> list[list[str]]:
        """Replica groups in order of preference: Ray tries the first group, taking its replica
        with the shortest queue, then the next. ``loads``: requests in flight per replica as Ray
        last saw them (this router's own count stands in for any it lacks)."""
        if not replicas:
            return []
        load = {r: (loads or {}).get(r, self._in_flight.get(r, 0)) for r in replicas}
        least = min(load.values())
        if self.use_prefix and text:
            best, matched = self.best_match(text, replicas)
            if matched and load[best] - least <= self.imbalance:
                return [[best], [r for r in replicas if r != best]]
        # Least loaded: one group, so Ray picks the shortest queue among them by its own probes.
        return [sorted(replicas, key=lambda r: load[r])]

    def best_match(self, text: str, replicas: Sequence[str]) -> tuple[str, int]:
        """The replica holding the most leading blocks of ``text``, and how many it holds."""
        hashes = block_hashes(text)
        best, matched = replicas[0], 0
        for replica in replicas:
            held = self._held.get(replica)
            if not held:
                continue
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n > matched:
                best, matched = replica, n
        return best, matched

    def routed(self, replica: str, text: str | None) -> None:
        """``replica`` was sent a request with ``text``: it will hold that text's blocks."""
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        if not (self.use_prefix and text):
            return
        held = self._held.setdefault(replica, OrderedDict())
        for h in block_hashes(text):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def completed(self, replica: str) -> None:
        """A request sent to ``replica`` ended (either way)."""
        if self._in_flight.get(replica, 0) > 0:
            self._in_flight[replica] -= 1

    def keep_only(self, replicas: Sequence[str]) -> None:
        """Forget replicas no longer running (a replacement starts with an empty cache)."""
        alive = set(replicas)
        for gone in [r for r in self._held if r not in alive]:
            del self._held[gone]
        for gone in [r for r in self._in_flight if r not in alive]:
            del self._in_flight[gone]

    def held_blocks(self, replica: str) -> int:
        """How many blocks ``replica`` is taken to hold."""
        return len(self._held.get(replica, ()))
