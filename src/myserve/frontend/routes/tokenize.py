"""Token ids without generating (vLLM's extension): ``/tokenize`` (a prompt, or chat messages as the
template renders them) and ``/detokenize``."""

from __future__ import annotations

from fastapi import APIRouter

from myserve.frontend.errors import APIError
from myserve.frontend.protocol import DetokenizeRequest, TokenizeRequest
from myserve.frontend.served_models import Models

router = APIRouter()


# The token ids of ``prompt`` or of the rendered ``messages``, with the context length.
@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, models: Models) -> dict:
    context = models.resolve(req.model)
    context.check_ready()
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if req.messages is not None:
        ids = context.encode_chat(context.render_text(req.messages, req, template_kwargs=req.chat_template_kwargs))
    else:
        ids = context.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": context.engine.max_model_len}


# The text of ``tokens`` (special tokens included).
@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, models: Models) -> dict:
    context = models.resolve(req.model)
    context.check_ready()
    context.check_token_ids(req.tokens, "tokens")
    return {"prompt": context.tokenizer.decode(req.tokens, skip_special_tokens=False)}
