"""The request guard: body size and API key, checked before a request reaches its route.

A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware``
relays every chunk of a streamed response through an anyio memory stream, which cost about a
quarter of the front end's Python time per streamed token (py-spy, one stream of 128 tokens).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from myserve.frontend.errors import APIError

OPEN_PATHS = ("/health", "/healthz", "/ping", "/version", "/metrics", "/docs", "/openapi.json", "/redoc")
"""Paths (and what is under them) served without the API key."""
OPEN_PAGES = ("/", "/chat")
"""Exact paths served without the API key: the chat page, which asks for the key itself."""


class RequestGuard:
    """413 for a declared body above ``max_body_bytes``; 401 without the API key (when one is set)."""

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
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return APIError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        path = scope["path"]
        if self.api_key is not None and not path.startswith(OPEN_PATHS) and path not in OPEN_PAGES:
            given = headers.get(b"authorization", b"").decode("latin-1")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return APIError(401, "invalid or missing API key", code="invalid_api_key")
        return None
