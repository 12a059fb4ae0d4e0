"""``/v1/responses``: the OpenAI Responses API, without storage. The request is translated into a
chat completions request (``responses_protocol.py::chat_request``) and prepared by the chat route's
own ``prepare_chat`` (template, tools, grammar, sampling, parsers); only the answer's shapes differ
(``responses_api_output.py``). Errors name the Responses request's fields."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from myserve.frontend.errors import APIError
from myserve.frontend.generation import admit, respond
from myserve.frontend.responses_api_output import ResponsesAnswer
from myserve.frontend.responses_protocol import ResponsesRequest, chat_request, responses_param
from myserve.frontend.routes.chat import prepare_chat
from myserve.frontend.served_models import Models

router = APIRouter()


# Translate into a chat request, prepare it as chat completions do, submit; a response object or its events.
@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request, models: Models) -> Response:
    context = models.resolve(req.model)
    expires = admit(context, req)
    echo = _echo(req)
    try:
        chat = chat_request(req)
        response, param = prepare_chat(context, chat, expires, kind="responses")
        return await respond(context, request, response, req.stream, param, lambda *a: ResponsesAnswer(*a, echo=echo))
    except APIError as e:
        e.param = responses_param(e.param)
        raise


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as the response object repeats them."""
    tools = [t.model_dump() for t in req.tools or []]
    choice: Any = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    elif not isinstance(choice, str):
        choice = choice.model_dump()
    fmt = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": fmt},
        "reasoning": {"effort": None, "summary": None},
        "previous_response_id": None,
    }
