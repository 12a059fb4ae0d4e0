"""The chat page: ``/chat`` serves one static HTML file shipped in the package (no build step, no
CDN: everything it loads comes from this server), and ``/`` redirects to it. Both are served
without the API key; the page asks for one when ``/v1/models`` answers 401."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, RedirectResponse

router = APIRouter()


@cache
def page_html() -> str:
    """The page's text (read once from the package)."""
    return resources.files("myserve.frontend").joinpath("static/chat.html").read_text(encoding="utf-8")


# The page to try the served models in a browser.
@router.get("/chat", include_in_schema=False)
async def chat_page() -> HTMLResponse:
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-cache"})


# The server's root: the chat page.
@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    return RedirectResponse("/chat")
