"""Engine outputs to OpenAI JSON: choices, logprobs in OpenAI's exact schemas, usage, stream chunks."""

from __future__ import annotations

from myserve.engine.detokenizer import token_bytes
from myserve.engine.outputs import TokenLogprob, Usage
from myserve.tokenizer import Tokenizer


def usage_json(usage: Usage) -> dict:
    """OpenAI ``usage``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class LogprobFormatter:
    """Token strings and bytes for logprobs, cached per token id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def raw(self, token_id: int) -> bytes:
        """The token's bytes."""
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = token_bytes(self.tokenizer, token_id)
        return b

    def text(self, token_id: int) -> str:
        """The token as text (invalid UTF-8 of a partial character replaced)."""
        return self.raw(token_id).decode("utf-8", errors="replace")

    def chat(self, entries: list[TokenLogprob]) -> dict:
        """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs[]}]}``."""

        def one(token_id: int, logprob: float) -> dict:
            return {"token": self.text(token_id), "logprob": logprob, "bytes": list(self.raw(token_id))}

        return {
            "content": [
                {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries
            ]
        }

    def completion(self, entries: list[TokenLogprob], start_offset: int = 0) -> dict:
        """Completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``."""
        tokens, offsets, offset = [], [], start_offset
        for e in entries:
            s = self.text(e.token_id)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }
