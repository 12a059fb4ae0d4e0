"""The request guard: body size and API key, checked before a request reaches its route.

A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware``
relays every chunk of a streamed response through an anyio memory stream, which cost about a
quarter of the front end's Python time per streamed token (py-spy, one stream of 128 tokens).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from myserve.frontend.errors import APIError

OPEN_PATHS = ("/health", "/healthz", "/ping", "/version", "/metrics", "/docs", "/openapi.json", "/redoc")
"""Paths (and what is under them) served without the API key."""
OPEN_PAGES = ("/", "/chat")
"""Exact paths served without the API key: the chat page, which asks for the key itself."""
_MAX_HEADER = 2048
IGNORED_FIELDS_HEADER = "x-ignored-fields"
"""Names the request body's fields that the server did not read (comma-separated), when there are
any: a route puts them in the request's state (``generation.admit``)."""


class RequestGuard:
    """413 for a declared body above ``max_body_bytes``; 401 without the API key (when one is set);
    the ``IGNORED_FIELDS_HEADER`` on the answer of a request whose route noted ignored fields."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check an HTTP request, then pass it on."""
        if scope["type"] == "http":
            refused = self._refusal(scope)
            if refused is not None:
                await refused.response()(scope, receive, send)
                return
            send = _naming_ignored_fields(scope, send)
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return APIError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        path = scope["path"]
        if self.api_key is not None and not path.startswith(OPEN_PATHS) and path not in OPEN_PAGES:
            return key_refusal(headers.get(b"authorization", b"").decode("latin-1"), self.api_key)
        return None


def key_refusal(authorization: str, api_key: str) -> APIError | None:
    """The 401 for an ``Authorization`` header that is not ``Bearer <api_key>`` (compared in
    constant time); None when it is. Also the Ray ingress's check of its own routes."""
    token = authorization[7:] if authorization.lower().startswith("bearer ") else ""
    if hmac.compare_digest(token.encode(), api_key.encode()):
        return None
    return APIError(401, "invalid or missing API key", code="invalid_api_key")


def _printable(name: str) -> str:
    """A client's field name as header text: JSON-escaped, printable ASCII only, stripped."""
    return "".join(c if " " <= c <= "~" else "?" for c in json.dumps(name)[1:-1]).strip()


def _naming_ignored_fields(scope: Scope, send: Send) -> Send:
    """``send`` adding ``IGNORED_FIELDS_HEADER`` to the response's start when the route noted fields
    (Starlette keeps ``request.state`` in the scope's ``state`` dict)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            ignored = scope.get("state", {}).get("ignored_fields")
            # Field names are the client's: JSON-escaped (ASCII), anything else unprintable as "?",
            # blank ones left out, the whole bounded (a header value may not start or end with a blank).
            names = [shown for name in ignored or () if (shown := _printable(name))]
            value = ", ".join(names)[:_MAX_HEADER].strip().encode("ascii")
            if value:
                message = {**message, "headers": [*message.get("headers", []), (IGNORED_FIELDS_HEADER.encode(), value)]}
        await send(message)

    return sending
