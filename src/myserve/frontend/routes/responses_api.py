"""``/v1/responses``: the OpenAI Responses API. The request is translated into a chat completions
request (``responses_protocol.py::chat_request``) and prepared by the chat route's own
``prepare_chat`` (template, tools, grammar, sampling, parsers); only the answer's shapes differ
(``responses_api_output.py``). Errors name the Responses request's fields.

Stored responses (``frontend/responses_store.py``, the app's ``ServerState.responses``): the final
object of a ``store`` request (absent: stored, as OpenAI's, when the server stores any), read back
with ``GET /v1/responses/{id}``, removed with ``DELETE``; its conversation continued by a request
naming it as ``previous_response_id``. A ``background`` request is answered at once with a
``queued`` object while a task the store holds generates it; ``POST /v1/responses/{id}/cancel``
cancels that task (closing its streams aborts the engine requests), and a failure is stored as a
``failed`` object with its ``error``."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from myserve.frontend.app_context import AppContext
from myserve.frontend.errors import APIError
from myserve.frontend.generation import admit, respond, submit_answer
from myserve.frontend.responses import ResponseContext
from myserve.frontend.responses_api_output import ResponsesAnswer
from myserve.frontend.responses_protocol import (
    ResponsesRequest,
    chat_request,
    conversation_after,
    input_messages,
    responses_param,
)
from myserve.frontend.responses_store import ResponseStore, StoredResponse
from myserve.frontend.routes.chat import chat_images, prepare_chat
from myserve.frontend.served_models import Models

router = APIRouter()
logger = logging.getLogger(__name__)


# Translate into a chat request, prepare it as chat completions do, submit; a response object or its
# events (stored when asked), or, in the background, the queued response object.
@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request, models: Models) -> Response:
    context = models.resolve(req.model)
    expires = admit(context, req, request)
    store = context.state.responses
    stored = _stored_flag(req, store)
    history = _history(req, store)
    echo = _echo(req, stored)
    try:
        chat = chat_request(req, history)
        pixels = await chat_images(context, chat)
        response, param = prepare_chat(context, chat, expires, kind="responses", pixels=pixels)
        conversation = input_messages(req, history)
        if req.background:
            return _start_background(context, request, response, param, echo, conversation)

        def keep(final: dict[str, Any]) -> None:
            store.put(final["id"], StoredResponse(final, conversation_after(conversation, final["output"])))

        def answer(*a: Any) -> ResponsesAnswer:
            return ResponsesAnswer(*a, echo=echo, on_final=keep if stored else None)

        return await respond(context, request, response, req.stream, param, answer)
    except APIError as e:
        e.param = responses_param(e.param)
        raise


# A stored response as it is now (a background one: queued, in_progress, then its final object).
@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, models: Models, stream: bool = False) -> JSONResponse:
    if stream:
        message = "streaming a stored response again is not supported"
        raise APIError(400, message, param="stream", code="unsupported_parameter")
    return JSONResponse(_entry(models.state.responses, response_id).response)


# Forget a stored response (a background one still generating is cancelled).
@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, models: Models) -> JSONResponse:
    if models.state.responses.pop(response_id) is None:
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


# Cancel a background response still generating; one that has ended is returned as it is.
@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, models: Models) -> JSONResponse:
    entry = _entry(models.state.responses, response_id)
    if not entry.response.get("background"):
        raise APIError(400, "Only background responses can be cancelled.", code="invalid_request")
    task = entry.task
    if task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task})  # its done callback (``_settle``) has then marked it cancelled
    return JSONResponse(entry.response)


def _entry(store: ResponseStore, response_id: str) -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", code="not_found")


def _stored_flag(req: ResponsesRequest, store: ResponseStore) -> bool:
    """Whether the response is stored: ``store`` absent or null means true when the server stores
    responses (OpenAI's default). 400 for ``store: true`` without storage, and for a ``background``
    request that would not be stored or asks to stream."""
    if req.store and not store.enabled:
        message = "this server stores no responses (server.responses_store_size is 0): leave store out or send false"
        raise APIError(400, message, param="store", code="unsupported_parameter")
    stored = store.enabled and req.store is not False
    if req.background and not stored:
        message = "a background response must be stored (store true, on a server that stores responses)"
        raise APIError(400, message, param="background", code="invalid_value")
    if req.background and req.stream:
        message = "streaming a background response is not supported (poll GET /v1/responses/{id})"
        raise APIError(400, message, param="stream", code="unsupported_parameter")
    return stored


def _history(req: ResponsesRequest, store: ResponseStore) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` continues (chat messages; none without one): 400,
    as OpenAI answers, for an id not stored, and for a response still generating (no output yet)."""
    previous = req.previous_response_id
    if previous is None:
        return []
    if not store.enabled:
        message = "this server stores no responses (server.responses_store_size is 0): no previous_response_id"
        raise APIError(400, message, param="previous_response_id", code="unsupported_parameter")
    entry = store.get(previous)
    if entry is None:
        message = f"Previous response with id '{previous}' not found."
        raise APIError(400, message, param="previous_response_id", code="previous_response_not_found")
    if entry.running:
        message = f"Previous response with id '{previous}' is still in progress."
        raise APIError(400, message, param="previous_response_id", code="invalid_value")
    return entry.conversation


def _start_background(
    context: AppContext,
    request: Request,
    response: ResponseContext,
    grammar_field: str,
    echo: dict[str, Any],
    conversation: list[dict[str, Any]],
) -> JSONResponse:
    """Submit the request (its refusals are still this request's errors), store it queued, and
    generate it in a task the store holds; the queued response object."""
    entry = StoredResponse({}, conversation)

    def keep(final: dict[str, Any]) -> None:
        entry.response = final
        entry.conversation = conversation_after(conversation, final["output"])

    answer = submit_answer(
        context, request, response, grammar_field, lambda *a: ResponsesAnswer(*a, echo=echo, on_final=keep)
    )
    entry.response = answer.response_object("queued")
    store = context.state.responses
    store.put(response.request_id, entry)
    task = store.run(entry, _generate(answer, entry))
    task.add_done_callback(functools.partial(_settle, answer, entry))
    return JSONResponse(entry.response)


async def _generate(answer: ResponsesAnswer, entry: StoredResponse) -> None:
    """A background response's generation. Nobody awaits it, so a failure is stored (status
    ``failed`` with its ``error``), never raised; its final object is stored by ``on_final``."""
    entry.response = answer.response_object("in_progress")
    try:
        await answer.detached()
    except APIError as e:  # the deadline, an engine error (the request is counted already)
        entry.response = answer.response_object("failed", e)
    except Exception as e:
        logger.exception("background response %s failed", answer.ctx.request_id)
        answer.abandon("error")
        error = APIError(500, f"internal error: {type(e).__name__}", code="server_error")
        entry.response = answer.response_object("failed", error)


def _settle(answer: ResponsesAnswer, entry: StoredResponse, task: asyncio.Task[None]) -> None:
    """A background task's end: cancelled (a cancel request, a delete, an eviction, the app's
    shutdown; perhaps before it ever ran), its engine requests are aborted and it is stored cancelled."""
    if task.cancelled():
        answer.abandon()
        entry.response = answer.response_object("cancelled")


def _echo(req: ResponsesRequest, stored: bool) -> dict[str, Any]:
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
        "store": stored,
        "background": bool(req.background),
        "previous_response_id": req.previous_response_id,
    }
