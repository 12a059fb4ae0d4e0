"""The httpx settings both clients share: the server's root, the API key, the default timeout."""

from __future__ import annotations

from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
"""Where ``python -m myserve.serve`` listens by default."""


def server_root(base_url: str) -> str:
    """The server's root: paths are sent as ``/v1/...`` and ``/health``, so an OpenAI-style base
    URL ending in ``/v1`` is taken too."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def http_options(base_url: str, api_key: str | None, timeout: float) -> dict[str, Any]:
    """Keyword arguments of ``httpx.Client`` / ``httpx.AsyncClient``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return {"base_url": server_root(base_url), "headers": headers, "timeout": timeout}
