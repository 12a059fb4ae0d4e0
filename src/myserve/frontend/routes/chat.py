"""``/v1/chat/completions``: the chat template (with tools), tool-call and reasoning parsing."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response

from myserve.frontend.app_context import AppContext
from myserve.frontend.chat_output import ChoiceParser
from myserve.frontend.errors import APIError
from myserve.frontend.generation import admit, grammar_param, max_tokens_of, respond, sampling_params
from myserve.frontend.images import Processed
from myserve.frontend.protocol import ChatCompletionRequest
from myserve.frontend.reasoning import ReasoningParser, State
from myserve.frontend.responses import ResponseContext
from myserve.frontend.served_models import Models
from myserve.frontend.structured import request_grammar
from myserve.frontend.tools import ToolPlan, plan_tools
from myserve.wire.images import ImageInput
from myserve.wire.params import MAX_TOP_LOGPROBS

router = APIRouter()


# Validate, render the messages (and tools) with the chat template, submit; JSON or SSE.
@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, models: Models) -> Response:
    context = models.resolve(req.model)
    expires = admit(context, req, request)
    pixels = await chat_images(context, req)
    response, param = prepare_chat(context, req, expires, pixels=pixels)
    return await respond(context, request, response, req.stream, param)


async def chat_images(context: AppContext, req: ChatCompletionRequest) -> list[Processed]:
    """The preprocessed pixels of the messages' image parts, in order (``frontend/images.py``); a
    400 for images sent to a model that takes none."""
    urls = [url for m in req.messages for url in m.image_urls()]
    if not urls:
        return []
    support = context.engine.images
    if support is None:
        raise APIError(400, "this model does not take images", param="messages", code="invalid_value")
    return await support.pixels(urls)


def prepare_chat(
    context: AppContext,
    req: ChatCompletionRequest,
    expires: float | None,
    kind: str = "chat",
    pixels: Sequence[Processed] = (),
) -> tuple[ResponseContext, str]:
    """A chat request made ready to submit: checked (400 naming the field), its constraint and tool
    plan made, its messages rendered with the chat template, its sampling parameters set. Returns the
    response's context (``kind``: its shape, ``"chat"`` or ``"responses"``) and the request field
    that errors about its grammar name. The Responses API's route comes here too, through a chat
    request made of its input. ``pixels``: the image parts' (``chat_images``), in order."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        message = f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}"
        raise APIError(400, message, param="top_logprobs", code="invalid_value")
    max_tokens: int | None = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = max_tokens_of(req, req.max_tokens)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    grammar = request_grammar(req)
    plan = plan_tools(req, context.auto_parser)
    if plan.grammar is not None:
        if grammar is not None:
            raise APIError(
                400,
                "a forced tool call (tool_choice required or a named function) cannot be combined with "
                "response_format or structured_outputs",
                param="tool_choice",
                code="invalid_value",
            )
        grammar = plan.grammar
    text = context.render_text(req.messages, req, plan.template_tools, req.template_variables())
    reasoning = context.reasoning
    state: State = reasoning.initial_state(text) if reasoning else "content"
    # With a reasoning parser, a grammar constrains only what follows the reasoning block.
    after = tuple(context.encode_chat(reasoning.end)) if reasoning else ()
    params = sampling_params(
        context,
        req,
        max_tokens,
        logprobs,
        grammar=grammar,
        grammar_after=after if grammar is not None and state != "content" else (),
        skip_special_tokens=False if plan.keeps_special_tokens else None,
    )
    images = list[ImageInput]()
    if pixels:
        assert context.engine.images is not None, "chat_images refuses images for a text-only model"
        if req.truncate_prompt_tokens:
            message = "truncate_prompt_tokens cannot cut a prompt holding images"
            raise APIError(400, message, param="truncate_prompt_tokens", code="invalid_value")
        prompt, images = context.engine.images.expand(text, pixels, context.encode_chat)
    else:
        prompt = context.encode_chat(text)
    response = ResponseContext(
        kind=kind,
        model=req.model,  # the name the client used (an alias stays an alias)
        prompts=context.truncate([prompt], req.truncate_prompt_tokens),
        images=tuple(images),
        params=params,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        deadline=expires,
        choice_parser=_choice_parsers(context, req, plan, state),
        chat_echo=_echo(req),
        prompt_logprobs=req.prompt_logprobs,
        token_ids_as_text=req.return_tokens_as_token_ids or context.return_tokens_as_token_ids,
    )
    return response, "tools" if plan.grammar is not None else grammar_param(req)


def _echo(req: ChatCompletionRequest) -> str:
    """With ``echo``, the final message's content when it is the answer's role's (vLLM's)."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == "assistant" else ""


def _choice_parsers(
    context: AppContext, req: ChatCompletionRequest, plan: ToolPlan, state: State
) -> Callable[[], ChoiceParser] | None:
    """Makes each choice's reasoning and tool-call parser (None: the text is the message's content).

    ``state``: where the rendered prompt leaves the reasoning parser (inside a block or not)."""
    reasoning, new_tools = context.reasoning, plan.parser
    if reasoning is None and new_tools is None:
        return None

    def choice_parser() -> ChoiceParser:
        return ChoiceParser(
            ReasoningParser(reasoning, state) if reasoning else None,
            new_tools() if new_tools else None,
            parallel_tool_calls=req.parallel_tool_calls,
        )

    return choice_parser
