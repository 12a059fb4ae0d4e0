"""The front half of generation: the engine core's token deltas made into text deltas.

The core (``core/engine_core.py``) samples tokens and ends a choice on EOS, a stop token id or its
length; it never detokenizes. This processor owns each choice's incremental detokenizer and stop
strings: it turns each token delta into the text it completes, ends a choice whose stop string
matched (and tells the core to abort just that choice: n > 1 siblings go on), drops the tokens the
core sampled for a choice it had already ended, and counts each choice's tokens up to its end, so
that usage ends at a stop string. It runs wherever the request streams live: on the engine thread
of an in-process ``GenerationService``, or in the HTTP front end's process when the core runs in
its own.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable

from myserve.frontend.detokenizer import IncrementalDetokenizer
from myserve.frontend.stop import StopChecker
from myserve.frontend.stream import RequestStream
from myserve.tokenizer import Tokenizer
from myserve.wire.outputs import RequestOutput
from myserve.wire.params import SamplingParams


class _Choice:
    """One choice's text state."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopChecker(params.stop, include=params.include_stop_str_in_output)
        self.tokens = 0
        """Tokens delivered, up to the one that ended the choice."""
        self.done = False


class _Tracked:
    """One request's streams and choices."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, stream: RequestStream):
        self.prompt_ids, self.params, self.stream = prompt_ids, params, stream
        self.choices: dict[int, _Choice] = {}


class OutputProcessor:
    """Token deltas of many requests -> their streams' text deltas (thread-safe ``track``)."""

    def __init__(self, tokenizer: Tokenizer, abort_choice: Callable[[str, int], None]):
        """``abort_choice(request_id, choice)`` tells the core a choice ended on a stop string."""
        self.tokenizer = tokenizer
        self._abort_choice = abort_choice
        self._requests: dict[str, _Tracked] = {}
        self._lock = threading.Lock()  # track() runs on the submitting thread, process() on another

    def track(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stream: RequestStream) -> None:
        """Register a request before the core can answer it."""
        with self._lock:
            self._requests[request_id] = _Tracked(prompt_ids, params, stream)

    def forget(self, request_id: str) -> _Tracked | None:
        """Stop tracking a request (never submitted after all); its state."""
        with self._lock:
            return self._requests.pop(request_id, None)

    def process(self, outputs: Iterable[RequestOutput]) -> None:
        """Deliver the core's outputs to their streams, as text (one wake-up per event loop)."""
        delivered: list[tuple[RequestStream, RequestOutput]] = []
        for out in outputs:
            with self._lock:
                req = self._requests.get(out.request_id)
            if req is not None:
                text_out = self._one(req, out)
                if text_out is not None:
                    delivered.append((req.stream, text_out))
        RequestStream.put_many(delivered)

    def _one(self, req: _Tracked, out: RequestOutput) -> RequestOutput | None:
        """The text delta of one output (None: dropped)."""
        if out.final:
            with self._lock:
                self._requests.pop(out.request_id, None)
            usage = out.usage
            if usage is not None:  # completion tokens as delivered: a stop string ends the count
                usage = dataclasses.replace(usage, completion_tokens=sum(c.tokens for c in req.choices.values()))
            return dataclasses.replace(out, usage=usage)
        if out.embedding is not None:  # an embedding request's one delta: no text
            return out
        choice = req.choices.get(out.choice)
        if choice is None:
            choice = req.choices[out.choice] = _Choice(self.tokenizer, req.prompt_ids, req.params)
        if choice.done:
            return None  # sampled before the core heard that the choice had ended here
        finish, stop_reason = out.finish_reason, out.stop_reason
        text = ""
        ids = list(out.token_ids)  # (a several-token call's delta holds several)
        # The core ends on the delta's last token, EOS or a stop id: neither is text, unless a stop
        # id's text is asked for.
        not_text = bool(ids) and finish == "stop" and not _keeps_stop_id(req.params, out.stop_reason)
        text_ids = ids[:-1] if not_text else ids
        stopped = False
        parts: list[str] = []  # token by token's texts
        if not choice.stops.stop or len(text_ids) <= 1:  # (no stop strings: the delta at once)
            choice.tokens += len(text_ids)
            if text_ids:
                text, stopped = choice.stops.feed(choice.detok.add(text_ids))
        else:  # stop strings: token by token, so that the count ends at the token that matched
            for token in text_ids:
                choice.tokens += 1
                part, stopped = choice.stops.feed(choice.detok.add([token]))
                parts.append(part)
                if stopped:
                    break
            text = "".join(parts)
        if stopped:
            finish, stop_reason = "stop", choice.stops.matched
            if out.finish_reason is None:
                self._abort_choice(out.request_id, out.choice)
            used = len(parts) if parts else len(ids)  # the tokens after the match are dropped
            if used < len(ids):
                lps = None if out.logprobs is None else out.logprobs[:used]
                out = dataclasses.replace(out, token_ids=out.token_ids[:used], logprobs=lps)
        elif not_text:
            choice.tokens += 1  # the EOS or stop id counts as generated
        if finish is not None:
            choice.done = True
            if not choice.stops.stopped and finish in ("stop", "length"):
                # Ending for another reason than a stop string: release held-back text.
                tail, _ = choice.stops.feed(choice.detok.finish())
                text += tail + choice.stops.flush()
        return with_text(out, text, finish, stop_reason)


def with_text(out: RequestOutput, text: str, finish: str | None, stop_reason: int | str | None) -> RequestOutput:
    """``out`` with its text, finish and stop reason set: ``dataclasses.replace`` without its
    per-call field introspection (once per delta of every stream; a test holds it to replace)."""
    return RequestOutput(
        out.request_id, out.choice, out.token_ids, text, out.logprobs, finish, stop_reason, out.usage, out.error,
        out.prompt_logprobs, out.embedding, out.weights_version,
    )  # fmt: skip


def _keeps_stop_id(params: SamplingParams, stop_reason: int | str | None) -> bool:
    """Whether a choice that a stop token id ended keeps that token's text
    (``include_stop_str_in_output``, as vLLM: EOS is never text)."""
    return params.include_stop_str_in_output and isinstance(stop_reason, int)
