"""Cross-origin requests (CORS), as vLLM answers them: Starlette's ``CORSMiddleware`` with the
server's allowed origins, methods and headers, outside the request guard.

Outside, so that a browser's preflight (``OPTIONS`` with ``Access-Control-Request-Method``, which
never carries the API key) is answered before the guard would refuse it, and so that the guard's own
refusals (401, 413) carry the CORS headers a page needs to read them. A real cross-origin request
still passes through the guard: only preflights stop here.
"""

from __future__ import annotations

import dataclasses

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp

from myserve.frontend.errors import APIError


@dataclasses.dataclass(frozen=True, kw_only=True)
class CORSPolicy:
    """Which cross-origin requests a browser may make (vLLM's ``--allowed-*`` flags)."""

    allowed_origins: tuple[str, ...] = ("*",)
    """Origins (``scheme://host[:port]``) whose pages may call the API; ``*`` = any."""
    allowed_methods: tuple[str, ...] = ("*",)
    """HTTP methods a preflight may ask for; ``*`` = any."""
    allowed_headers: tuple[str, ...] = ("*",)
    """Request headers a preflight may ask for; ``*`` = any."""
    allow_credentials: bool = False
    """Let pages send cookies and HTTP authentication (the origin is echoed instead of ``*``)."""


class CORS(CORSMiddleware):
    """``CORSMiddleware`` whose refused preflight is an OpenAI-shaped error, as every other one is."""

    def __init__(self, app: ASGIApp, policy: CORSPolicy):
        super().__init__(
            app,
            allow_origins=policy.allowed_origins,
            allow_methods=policy.allowed_methods,
            allow_headers=policy.allowed_headers,
            allow_credentials=policy.allow_credentials,
        )

    def preflight_response(self, request_headers: Headers) -> Response:
        """The preflight's answer: 200 with the CORS headers, or 400 naming what is not allowed."""
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        what = bytes(response.body).decode().removeprefix("Disallowed CORS ")  # e.g. "origin, method"
        refused = APIError(400, f"CORS preflight refused: {what} not allowed", code="cors_not_allowed").response()
        for name, value in response.headers.items():
            if name.startswith("access-control-") or name == "vary":
                refused.headers[name] = value
        return refused
