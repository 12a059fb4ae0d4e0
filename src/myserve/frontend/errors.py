"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error to send to the client as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON envelope."""
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """As a response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Drop pydantic's union-branch labels (e.g. "str", "list[int]") from the reported path.
    clean = [p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")]
    return ".".join(clean) or None


def install_error_handlers(app: FastAPI) -> None:
    """Every error path of the app answers in OpenAI's envelope; nothing leaks as a bare 500."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _param(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            # Its loc is ("body", offset of the error): no field to name.
            message, param = "the request body is not valid JSON", None
        else:
            # Our own validators raise ValueError; pydantic prefixes its message with "Value error, ".
            message = f"{param or 'body'}: {str(first.get('msg')).removeprefix('Value error, ')}"
        return APIError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
