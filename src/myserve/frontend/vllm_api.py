"""vLLM's OpenAI-server request fields and endpoints, and what this server does with each: the
README's "Coming from vLLM" tables are ``markdown_tables()``, and ``tests/test_vllm_fields.py``
checks every row against the request schemas and the app's routes over HTTP (a ``same`` field is read by the
endpoints named, a ``not yet`` field is refused or named in the ``x-ignored-fields`` header, a
``same`` endpoint is routed, a ``not yet`` one is a 404).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Row:
    """One vLLM request field or endpoint."""

    name: str
    """The field (``bad_words``) or the endpoint (``POST /v1/score``)."""
    status: str
    """``same`` (what vLLM does), or ``not yet``: a field is then refused (400) or answered without
    it and named in the ``x-ignored-fields`` header; an endpoint is a 404."""
    where: str = ""
    """Fields: the endpoints that read it (``completions``, ``chat``, ``responses``, ``embeddings``)."""
    note: str = ""


FIELDS = [
    Row("top_k, min_p, repetition_penalty", "same", "completions, chat"),
    Row("stop_token_ids, ignore_eos, min_tokens", "same", "completions, chat"),
    Row("skip_special_tokens", "same", "completions, chat"),
    Row("include_stop_str_in_output", "same", "completions, chat", "a stop token id's text is kept too"),
    Row("bad_words", "same", "completions, chat", "vLLM's token rule, on the device's token masks"),
    Row("allowed_token_ids", "same", "completions, chat", "on the device's token masks; EOS only if listed"),
    Row("prompt_logprobs", "same", "completions, chat", "not with stream (as vLLM); at most --max-logprobs"),
    Row("truncate_prompt_tokens", "same", "completions, chat, embeddings", "-1: the context length"),
    Row("return_tokens_as_token_ids", "same", "completions, chat", "also --return-tokens-as-token-ids"),
    Row("structured_outputs", "same", "completions, chat", "json, json_object, regex, choice, grammar"),
    Row("echo", "same", "completions, chat", "chat: the final assistant message's content first"),
    Row("add_generation_prompt, continue_final_message", "same", "chat", "also /tokenize"),
    Row("documents", "same", "chat", "passed to the chat template"),
    Row("chat_template", "same", "chat", "needs --trust-request-chat-template"),
    Row("chat_template_kwargs", "same", "chat"),
    Row("reasoning_effort", "same", "chat", "passed to the chat template as reasoning_effort"),
    Row(
        "grammar, json_schema, n_predict",
        "same",
        "completions, chat",
        "llama-server's: GBNF, a JSON schema, max_tokens",
    ),
    Row("normalize, dimensions", "same", "embeddings"),
    Row("use_beam_search, length_penalty", "not yet", "", "no beam search"),
    Row("spaces_between_special_tokens", "not yet", "", "special tokens are joined as the tokenizer decodes"),
    Row("add_special_tokens", "not yet", "", "chat: the chat template writes the special tokens"),
    Row("priority", "not yet", "", "first come, first served"),
    Row("logits_processors", "not yet", "", "no custom logits processors"),
    Row("cache_salt", "not yet", "", "one prefix cache for all requests"),
    Row("return_token_ids", "not yet", "", "use return_tokens_as_token_ids with logprobs"),
    Row("mm_processor_kwargs", "not yet", "", "text models only"),
    Row("kv_transfer_params, vllm_xargs", "not yet", "", "no disaggregated prefill"),
]
"""vLLM's request fields beyond OpenAI's (OpenAI's own are in the endpoint table of the README)."""

ENDPOINTS = [
    Row("POST /v1/completions", "same"),
    Row("POST /v1/chat/completions", "same"),
    Row("POST /v1/responses", "same", note="stored responses in memory, bounded"),
    Row("GET /v1/responses/{response_id}", "same"),
    Row("DELETE /v1/responses/{response_id}", "same"),
    Row("POST /v1/responses/{response_id}/cancel", "same", note="background responses"),
    Row("POST /v1/embeddings", "same"),
    Row("GET /v1/models", "same"),
    Row("POST /tokenize", "same"),
    Row("POST /detokenize", "same"),
    Row("GET /health", "same"),
    Row("GET /ping", "same", note="and POST (SageMaker)"),
    Row("POST /invocations", "same", note="SageMaker: chat, completion or embeddings by the body"),
    Row("GET /version", "same"),
    Row("GET /metrics", "same", note="vLLM's metric names"),
    Row("GET /server_info", "same"),
    Row("POST /reset_prefix_cache", "same"),
    Row("POST /v1/score", "same", note="embedding models: cosine of the embeddings; also /score"),
    Row("POST /v1/rerank", "same", note="embedding models: cosine of the embeddings; also /rerank, /v2/rerank"),
    Row("POST /pooling", "not yet", note="use /v1/embeddings"),
    Row("POST /classify", "not yet", note="no classification heads"),
    Row("POST /v1/audio/transcriptions", "not yet", note="text models only"),
    Row("POST /v1/load_lora_adapter", "same", note="with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true and --enable-lora"),
    Row("POST /v1/unload_lora_adapter", "same", note="with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"),
    Row("POST /sleep", "same", note="with --enable-sleep-mode; also POST /wake_up, GET /is_sleeping"),
    Row("POST /start_profile", "not yet", note="profile with python -m myserve.bench.device"),
]
"""vLLM's OpenAI-server endpoints."""


def markdown_tables() -> str:
    """The README's tables of vLLM's request fields and endpoints."""
    lines = ["| vLLM request field | here | read by / note |", "|---|---|---|"]
    for row in FIELDS:
        names = ", ".join(f"`{n}`" for n in row.name.split(", "))
        detail = " — ".join(x for x in (row.where, row.note) if x)
        lines.append(f"| {names} | {row.status} | {detail} |")
    lines += ["", "| vLLM endpoint | here | note |", "|---|---|---|"]
    lines += [f"| `{row.name}` | {row.status} | {row.note} |" for row in ENDPOINTS]
    return "\n".join(lines) + "\n"
