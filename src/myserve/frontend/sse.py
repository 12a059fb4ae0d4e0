"""Server-sent events: one JSON payload per ``data:`` line, safe for clients that split lines."""

from __future__ import annotations

import msgspec

_encode = msgspec.json.Encoder().encode


_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))
"""Characters that JSON may leave raw but ``str.splitlines`` (httpx's ``iter_lines``, many SSE
clients) takes for line ends: escaped, or one token's text (a model emits U+2028 now and then) cuts
a ``data:`` line in two for such a client. In UTF-8 these byte runs stand for nothing else."""


def sse_event(payload: dict, event: str | None = None) -> bytes:
    """One server-sent event: ``data: <JSON>`` and a blank line (after ``event: <name>`` if named:
    the Responses API names each event by its type)."""
    # msgspec: UTF-8 as is (``ensure_ascii=False``), non-finite floats as null (valid JSON, where
    # ``json.dumps`` writes ``-Infinity``), and several times faster per streamed token.
    data = _encode(payload)
    if b"\xe2\x80" in data or b"\xc2\x85" in data:
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    head = b"event: " + event.encode() + b"\ndata: " if event else b"data: "
    return head + data + b"\n\n"
