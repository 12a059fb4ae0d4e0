"""What request routers ask of a backend, beyond the OpenAI routes: its load and a request's prompt
token ids without generating (their cache flush is ``/reset_prefix_cache``'s second path,
``/flush_cache``, in ``server_info.py``).

``vllm-router`` (and sglang's router, which it grew from) reads ``GET /get_load`` for its
power-of-two policy, fans ``POST /flush_cache`` out to every backend, and, for its cache-aware
policy, asks each backend for the token ids of a request (``POST /v1/chat/completions/render`` or
``/v1/completions/render``; ``/tokenize`` when those are missing). vLLM's own server answers
``GET /load``. ``docs/scaling-out.md`` says which router uses which.
"""

from __future__ import annotations

from fastapi import APIRouter

from myserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from myserve.frontend.routes.completions import completion_prompts
from myserve.frontend.served_models import Models
from myserve.frontend.tools import plan_tools

router = APIRouter()


# Requests in flight on this server (every model's): sglang's and vllm-router's load probe.
@router.get("/get_load")
async def get_load(models: Models) -> dict:
    return {"load": models.state.in_flight}


# The same count under vLLM's name and shape.
@router.get("/load")
async def load(models: Models) -> dict:
    return {"server_load": models.state.in_flight}


# The prompt token ids a chat request would be served with (its messages and tools through the
# chat template), without generating: what a cache-aware router matches across backends.
@router.post("/v1/chat/completions/render")
async def render_chat(req: ChatCompletionRequest, models: Models) -> dict:
    context = models.resolve(req.model)
    context.check_ready()
    plan = plan_tools(req, context.auto_parser)
    text = context.render_text(req.messages, req, plan.template_tools, req.template_variables())
    ids = context.truncate([context.encode_chat(text)], req.truncate_prompt_tokens)[0]
    return {"token_ids": ids, "max_model_len": context.engine.max_model_len}


# The token ids of each prompt of a completions request: one object, or a list for several prompts.
@router.post("/v1/completions/render")
async def render_completion(req: CompletionRequest, models: Models) -> dict | list[dict]:
    context = models.resolve(req.model)
    context.check_ready()
    prompts = completion_prompts(req.prompt, context.tokenizer.encode, "prompt")
    prompts = context.truncate(prompts, req.truncate_prompt_tokens)
    rendered = [{"token_ids": ids, "max_model_len": context.engine.max_model_len} for ids in prompts]
    return rendered[0] if isinstance(req.prompt, str) else rendered
