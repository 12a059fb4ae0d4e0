"""The output side of a several-token call: one delta per choice per call (K tokens) through the
``OutputProcessor`` on its own thread gives the text, the stop-string cut and the token count that
one delta per token gave, and the engine thread never detokenizes."""

from __future__ import annotations

import threading

import pytest

from myserve.bundled import bundled_gguf_path
from myserve.frontend.output_processor import OutputProcessor
from myserve.frontend.output_thread import OutputThread
from myserve.frontend.stream import RequestStream
from myserve.tokenizer import Tokenizer
from myserve.wire.outputs import RequestOutput, Usage
from myserve.wire.params import SamplingParams

TEXT = "The sea is wide and the sky is blue today"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(bundled_gguf_path())


def deliver(tokenizer: Tokenizer, params: SamplingParams, deltas: list[tuple[list[int], str | None, int | None]]):
    """Run one request's deltas (token ids, finish reason, stop id) through a processor on an
    ``OutputThread``; (text, finish reason, stop reason, completion tokens, aborted choices, token
    ids delivered)."""
    aborted: list[tuple[str, int]] = []
    processor = OutputProcessor(tokenizer, abort_choice=lambda rid, c: aborted.append((rid, c)))
    thread = OutputThread(processor)
    stream = RequestStream("r")
    processor.track("r", [1, 2, 3], params, stream)
    for ids, finish, stop in deltas:
        thread.put([RequestOutput("r", 0, tuple(ids), finish_reason=finish, stop_reason=stop)])
    thread.put([RequestOutput("r", -1, usage=Usage(3, sum(len(d[0]) for d in deltas)))])
    outs = list(stream)
    thread.close()
    text = "".join(o.text for o in outs if not o.final)
    last = [o for o in outs if not o.final][-1]
    delivered = [t for o in outs if not o.final for t in o.token_ids]
    return text, last.finish_reason, last.stop_reason, outs[-1].usage.completion_tokens, aborted, delivered


def split(ids: list[int], k: int) -> list[list[int]]:
    return [ids[i : i + k] for i in range(0, len(ids), k)]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_several_token_deltas_give_the_text_and_counts_of_single_ones(tokenizer: Tokenizer, k: int) -> None:
    ids = tokenizer.encode(TEXT)
    eos = tokenizer.eos_token_ids[0]
    plain = SamplingParams(max_tokens=64)
    # Ended by EOS, the last token of the last delta: not text, counted.
    deltas = [(d, None, None) for d in split([*ids, eos], k)]
    deltas[-1] = (deltas[-1][0], "stop", None)
    assert deliver(tokenizer, plain, deltas) == (TEXT, "stop", None, len(ids) + 1, [], [*ids, eos])
    # A stop string inside a delta: the text ends before it, the count at the token that completed
    # it, the core is told to abort the choice; the tokens after it in the delta are dropped.
    stop = SamplingParams(max_tokens=64, stop=["wide"])
    deltas = [(d, None, None) for d in split(ids, k)]
    upto = next(i for i in range(len(ids)) if "wide" in tokenizer.decode(ids[: i + 1])) + 1
    text, finish, reason, tokens, aborted, delivered = deliver(tokenizer, stop, deltas)
    assert (text, finish, reason, tokens, aborted) == ("The sea is ", "stop", "wide", upto, [("r", 0)])
    assert delivered == ids[:upto]


def test_processing_runs_on_the_output_thread_in_order(tokenizer: Tokenizer) -> None:
    """Deltas put from one thread are processed on the output thread, in the order put."""
    seen: list[str] = []
    processor = OutputProcessor(tokenizer, abort_choice=lambda rid, c: None)
    process = processor.process
    processor.process = lambda outs: (seen.append(threading.current_thread().name), process(outs))  # type: ignore[method-assign]
    thread = OutputThread(processor)
    stream = RequestStream("r")
    processor.track("r", [1], SamplingParams(max_tokens=8), stream)
    ids = tokenizer.encode(TEXT)
    for token in ids:
        thread.put([RequestOutput("r", 0, (token,))])
    thread.put([RequestOutput("r", -1, usage=Usage(1, len(ids)))])
    assert "".join(o.text for o in stream) == TEXT
    thread.close()
    assert seen and set(seen) == {"myserve-outputs"}


def test_with_text_keeps_every_other_field() -> None:
    """``with_text`` (the processor's fast ``dataclasses.replace``) carries every field a delta has."""
    import dataclasses

    from myserve.frontend.output_processor import with_text
    from myserve.wire.outputs import TokenLogprob

    fields = [f.name for f in dataclasses.fields(RequestOutput)]
    values = dict(
        request_id="r", choice=2, token_ids=(5, 6), text="", logprobs=(TokenLogprob(5, -0.5, ()),),
        finish_reason=None, stop_reason=None, usage=Usage(1, 2), error="e", prompt_logprobs=(None,),
        embedding=b"x", weights_version="v2",
    )  # fmt: skip
    assert sorted(values) == sorted(fields)  # a new field must be added to with_text (and here)
    out = RequestOutput(**values)
    assert with_text(out, "hi", "stop", "wide") == dataclasses.replace(
        out, text="hi", finish_reason="stop", stop_reason="wide"
    )
