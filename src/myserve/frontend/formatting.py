"""Engine outputs to OpenAI JSON: choices, logprobs in OpenAI's exact schemas, usage, stream chunks."""

from __future__ import annotations

from myserve.frontend.detokenizer import token_bytes
from myserve.tokenizer import Tokenizer
from myserve.wire.outputs import TokenLogprob, Usage


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
        return self.completion_items([(e.token_id, e.logprob, e.top) for e in entries], start_offset)

    def completion_items(
        self, items: list[tuple[int, float | None, tuple[tuple[int, float], ...] | None]], start_offset: int = 0
    ) -> dict:
        """As ``completion``, for (token id, logprob, top) items whose logprob may be None (a prompt's
        first token, with echo)."""
        tokens, offsets, offset = [], [], start_offset
        for token_id, _, _ in items:
            s = self.text(token_id)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [None if top is None else {self.text(t): v for t, v in top} for _, _, top in items],
            "text_offset": offsets,
        }

    def prompt_logprobs(self, prompt_ids: list[int], scores: tuple[TokenLogprob | None, ...], k: int) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {logprob,
        rank, decoded_token}}`` for the prompt token and the top ``k`` there."""
        out: list[dict[str, dict] | None] = []
        for token_id, score in zip(prompt_ids, scores, strict=True):
            if score is None:
                out.append(None)
                continue
            entries = {str(token_id): self._vllm_entry(token_id, score.logprob, score.rank)}
            for rank, (t, lp) in enumerate(score.top[:k], start=1):
                entries.setdefault(str(t), self._vllm_entry(t, lp, rank))
            out.append(entries)
        return out

    def _vllm_entry(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.text(token_id)}

    def prompt_items(
        self, prompt_ids: list[int], scores: tuple[TokenLogprob | None, ...], k: int | None = None
    ) -> list[tuple[int, float | None, tuple[tuple[int, float], ...] | None]]:
        """Echoed prompt tokens as completion items (the first token has no logprob), with at most
        ``k`` top logprobs each (None: all the engine sent)."""
        return [
            (t, None, None) if s is None else (t, s.logprob, s.top[:k]) for t, s in zip(prompt_ids, scores, strict=True)
        ]


class TokenIdFormatter(LogprobFormatter):
    """Logprobs naming each token ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``: a token
    that is not valid UTF-8 on its own stays identifiable)."""

    def raw(self, token_id: int) -> bytes:
        """``token_id:<id>`` as bytes."""
        return f"token_id:{token_id}".encode()
