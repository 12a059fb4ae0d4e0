"""The chat page in headless Chromium (Debian's ``chromium``, driven by playwright): it loads with
no console errors, lists the models, streams an answer equal to the API's own, shows TTFT and
tokens/s, and its Stop button aborts the request in the engine. Plus the API-key flow and that the
page fetches nothing from outside the server; a page of another origin calls the API where CORS allows it (a
real browser preflight) and is blocked where it does not."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from playwright import sync_api as playwright_api
from test_server import LiveServer

from myserve.frontend.app import create_app
from myserve.frontend.routes.page import page_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# .ci/run installs Chromium and sets MYSERVE_REQUIRE_BROWSER, so there these tests always run; a
# machine without a browser (the README's test command on a laptop) skips them.
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("MYSERVE_REQUIRE_BROWSER"),
    reason="Chromium is not installed (apt-get install chromium; .ci/run does it)",
)

MODEL = "smol"
KEY = "sk-page-test"


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def live(smol_service):
    server = LiveServer(create_app(smol_service, served_model_name=MODEL))
    yield server
    server.stop()


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1000, "height": 700})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def test_the_page_streams_an_answer_and_stop_aborts_it(browser, live, smol_service, tmp_path: Path) -> None:
    page, errors = open_page(browser, live.url + "/")  # the root redirects to the page
    assert page.url.endswith("/chat") and page.title() == "myserve chat"
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == [MODEL]
    page.fill("#system", "You are a helpful assistant.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    question = "What is the capital of France?"
    page.fill("#question", question)
    page.press("#question", "Enter")
    page.wait_for_selector(".assistant[data-state=done]", timeout=60_000)
    answer = page.inner_text(".assistant .content")
    stats = page.inner_text(".assistant .stats")
    assert answer and re.search(r"TTFT \d+\.\d\d s", stats) and re.search(r"\d+ tokens, \d+\.\d tokens/s", stats)
    # The streamed answer is the API's own answer to the same request.
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": question},
        ],
        "temperature": 0,
        "max_tokens": 24,
    }
    expected = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60).json()
    assert answer == expected["choices"][0]["message"]["content"]
    shot = Path(os.environ.get("MYSERVE_SCREENSHOT", tmp_path / "chat-page.png"))
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000

    # A long answer, stopped as soon as it streams: the engine aborts it (nothing left running)
    # and the server counts a request whose client went away.
    page.fill("#max-tokens", "400")  # the test engine holds 512 tokens
    page.fill("#question", "Write a long essay about the history of Rome.")
    page.click("#send")
    page.wait_for_function(
        "document.querySelectorAll('.assistant').length == 2 && "
        "document.querySelectorAll('.assistant .content')[1].textContent.length > 0",
        timeout=60_000,
    )
    page.click("#stop")
    page.wait_for_selector(".assistant[data-state=stopped]", timeout=10_000)
    deadline = time.monotonic() + 10
    while smol_service.stats().running:
        assert time.monotonic() < deadline, "the stopped request still runs in the engine"
        time.sleep(0.05)
    metrics = httpx.get(f"{live.url}/metrics").text
    assert re.search(r'myserve_requests_total\{[^}]*endpoint="chat"[^}]*status="disconnected"[^}]*\} 1\.0', metrics)
    assert "stopped" in page.inner_text(".assistant:nth-of-type(4) .stats")  # user, assistant, user, assistant
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    assert errors == []
    page.close()


def test_the_page_asks_for_the_api_key_when_the_server_has_one(browser, smol_service) -> None:
    server = LiveServer(create_app(smol_service, served_model_name=MODEL, api_key=KEY))
    try:
        assert httpx.get(f"{server.url}/chat").status_code == 200  # the page itself needs no key
        assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the API does
        page, errors = open_page(browser, server.url + "/chat")
        page.wait_for_selector("#key-row:not([hidden])")
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("document.querySelectorAll('#model option').length > 0")
        # The 401 the page expects is the only console error (the browser logs failed fetches).
        assert all("401" in e for e in errors)
        page.close()
    finally:
        server.stop()


def test_the_page_loads_nothing_from_outside_the_server() -> None:
    html = page_html()
    assert "<script>" in html and 'fetch("/v1/chat/completions"' in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "an external resource"
    assert not re.search(r"""fetch\(\s*["'`](https?:)?//""", html), "a fetch to another origin"


FETCH_FROM_ELSEWHERE = """async (url) => {
  try {
    const r = await fetch(url + "/v1/chat/completions", {
      method: "POST",
      headers: {"Content-Type": "application/json"},  // not a simple request: the browser preflights it
      body: JSON.stringify({model: "smol", messages: [{role: "user", content: "Hi"}], max_tokens: 4}),
    });
    const body = await r.json();
    return {status: r.status, tokens: body.usage.completion_tokens};
  } catch (e) {
    return {blocked: String(e)};
  }
}"""


@pytest.fixture(scope="module")
def other_origin():
    """A page served from another origin (another port): the browser applies CORS to its calls."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler API's name
            body = b"<!doctype html><title>elsewhere</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_page_of_another_origin_calls_the_api_only_where_cors_allows_it(browser, live, smol_service, other_origin):
    from myserve.frontend.cors import CORSPolicy

    page, _ = open_page(browser, other_origin + "/")
    # The default policy (any origin, as vLLM's): the preflight and the request go through.
    assert page.evaluate(FETCH_FROM_ELSEWHERE, live.url) == {"status": 200, "tokens": 4}
    # A server that allows only http://a.example: the browser blocks the call from this origin.
    strict = LiveServer(
        create_app(smol_service, served_model_name=MODEL, cors=CORSPolicy(allowed_origins=("http://a.example",)))
    )
    try:
        result = page.evaluate(FETCH_FROM_ELSEWHERE, strict.url)
        assert "blocked" in result and "Failed to fetch" in result["blocked"]
    finally:
        strict.stop()
    page.close()
