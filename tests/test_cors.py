"""CORS as vLLM answers it, over real HTTP through the real app (the tiny Llama): a browser-style
preflight is answered without the API key, a real cross-origin request still needs the key and
gets the CORS headers, and with ``--allowed-origins '["http://a.example"]'`` another origin gets none.
The policy comes from the flags through the config, as ``serve`` builds the app."""

from __future__ import annotations

import httpx
import pytest
from test_server import LiveServer

from myserve.entrypoints import serve
from myserve.frontend.http_server import app_for

KEY = "sk-cors"
PAGE = "http://a.example"
OTHER = "http://b.example"


def preflight(
    url: str, origin: str, method: str = "POST", headers: str = "authorization, content-type"
) -> httpx.Response:
    """What a browser sends before a cross-origin POST with a JSON body and a bearer token."""
    asked = {"Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers}
    return httpx.options(f"{url}/v1/completions", headers=asked)


def complete(url: str, origin: str, key: str | None = KEY) -> httpx.Response:
    """A cross-origin completion request (as a page's fetch sends it after its preflight)."""
    headers = {"Origin": origin, **({"Authorization": f"Bearer {key}"} if key else {})}
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}  # the tiny vocabulary: 256 ids
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def live_server(service, *flags: str) -> LiveServer:
    """The app ``serve`` would build with these command-line flags, over ``service``."""
    config = serve.config_from_args(serve.parse_args(["--api-key", KEY, *flags]))
    return LiveServer(app_for(config, service, "tiny"))


@pytest.fixture(scope="module")
def any_origin(tiny_service):
    server = live_server(tiny_service)  # the default: ["*"]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_origin(tiny_service):
    server = live_server(tiny_service, "--allowed-origins", f'["{PAGE}"]')
    yield server
    server.stop()


def test_default_any_origin_preflight_without_key_then_request_with_it(any_origin) -> None:
    pre = preflight(any_origin.url, OTHER)
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
    out = complete(any_origin.url, OTHER)
    assert out.status_code == 200 and out.json()["object"] == "text_completion", out.text
    assert out.headers["access-control-allow-origin"] == "*"
    # The preflight skipped the guard; the request itself did not, and the page can read why.
    refused = complete(any_origin.url, OTHER, key=None)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["access-control-allow-origin"] == "*"
    # An OPTIONS that is not a preflight (no Origin) is no way past the key.
    assert httpx.options(f"{any_origin.url}/v1/models").status_code == 401


def test_allowed_origins_only_those_get_cors_headers(one_origin) -> None:
    pre = preflight(one_origin.url, PAGE)
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == PAGE
    out = complete(one_origin.url, PAGE)
    assert out.status_code == 200 and out.headers["access-control-allow-origin"] == PAGE

    refused = preflight(one_origin.url, OTHER)
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "message": "CORS preflight refused: origin not allowed",
        "type": "invalid_request_error",
        "param": None,
        "code": "cors_not_allowed",
    }
    assert "access-control-allow-origin" not in refused.headers
    # A request from another origin is served (CORS is the browser's to enforce) with no CORS headers.
    other = complete(one_origin.url, OTHER)
    assert other.status_code == 200
    assert not [h for h in other.headers if h.startswith("access-control-")]


def test_allowed_methods_headers_and_credentials_flags(tiny_service) -> None:
    flags = ("--allowed-methods", '["GET"]', "--allowed-headers", '["authorization"]', "--allow-credentials")
    server = live_server(tiny_service, *flags)
    try:
        assert preflight(server.url, PAGE).json()["error"]["message"] == "CORS preflight refused: method not allowed"
        traced = preflight(server.url, PAGE, method="GET", headers="authorization, x-trace")
        assert traced.json()["error"]["message"] == "CORS preflight refused: headers not allowed"
        ok = preflight(server.url, PAGE, method="GET")  # content-type is CORS-safelisted: always allowed
        assert ok.status_code == 200 and ok.headers["access-control-allow-methods"] == "GET"
        # Credentials allowed: the origin is echoed, never "*" (which browsers refuse with credentials).
        assert ok.headers["access-control-allow-origin"] == PAGE
        assert ok.headers["access-control-allow-credentials"] == "true"
        out = httpx.get(f"{server.url}/v1/models", headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
        assert out.status_code == 200 and out.headers["access-control-allow-origin"] == PAGE
    finally:
        server.stop()


def test_flags_are_json_lists_like_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    config = serve.config_from_args(serve.parse_args(["--allowed-origins", '["http://a.example", "http://c.example"]']))
    assert config.server.allowed_origins == ("http://a.example", "http://c.example")
    assert config.server.allowed_methods == ("*",) and config.server.allow_credentials is False
    with pytest.raises(SystemExit) as exit_info:
        serve.parse_args(["--allowed-origins", "http://a.example"])
    assert exit_info.value.code == 2
    assert "expected a JSON list of strings" in capsys.readouterr().err
