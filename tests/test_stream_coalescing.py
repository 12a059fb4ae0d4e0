"""A stream's queued deltas coalesced when its consumer is slower than the engine: each choice's
waiting deltas as one, with the same tokens, text and logprobs, and nothing merged that would lose
or reorder information (``frontend/coalesce.py``, ``RequestStream``, ``merged``)."""

from __future__ import annotations

import asyncio
import random

from myserve.frontend.coalesce import coalesce, coalesce_tagged, merge
from myserve.frontend.output_streams import merged
from myserve.frontend.stream import RequestStream
from myserve.wire.outputs import RequestOutput, TokenLogprob, Usage


def lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.1 * token, ((token, -0.1 * token),))


def delta(choice: int, *tokens: int, finish: str | None = None, logprobs: bool = True, **kw) -> RequestOutput:
    """A delta of request "r" whose text is its token ids, one letter each."""
    return RequestOutput(
        "r",
        choice,
        tokens,
        "".join(chr(ord("a") + t % 26) for t in tokens),
        tuple(lp(t) for t in tokens) if logprobs else None,
        finish,
        kw.pop("stop_reason", None),
        **{"weights_version": "v1", **kw},
    )


FINAL = RequestOutput("r", -1, usage=Usage(3, 7))


def by_choice(outputs: list[RequestOutput]) -> dict[int, tuple[tuple[int, ...], str, tuple, list]]:
    """Per choice: token ids, text, logprobs and finish reasons, concatenated in order."""
    got: dict[int, tuple[tuple[int, ...], str, tuple, list]] = {}
    for o in outputs:
        if o.final:
            continue
        ids, text, lps, finishes = got.get(o.choice, ((), "", (), []))
        got[o.choice] = (ids + o.token_ids, text + o.text, lps + (o.logprobs or ()), finishes + [o.finish_reason])
    return {c: (ids, text, lps, [f for f in fs if f]) for c, (ids, text, lps, fs) in got.items()}


# -- the pure function ---------------------------------------------------------------------------
def test_a_choices_waiting_deltas_become_one() -> None:
    outs = [delta(0, 1), delta(0, 2, 3), delta(0, 4, finish="stop", stop_reason=4), FINAL]
    got = coalesce(outs)
    assert got == [
        RequestOutput(
            "r", 0, (1, 2, 3, 4), "bcde", tuple(lp(t) for t in (1, 2, 3, 4)), "stop", 4, weights_version="v1"
        ),
        FINAL,
    ]
    assert got[-1] is FINAL  # the final output is never touched
    assert coalesce(got) == got  # coalescing what is coalesced changes nothing


def test_choices_never_merge_with_each_other_and_keep_their_order() -> None:
    outs = [delta(0, 1), delta(1, 11), delta(0, 2), delta(2, 21), delta(1, 12, finish="length"), delta(0, 3), FINAL]
    got = coalesce(outs)
    assert [(o.choice, o.token_ids) for o in got] == [(0, (1, 2, 3)), (1, (11, 12)), (2, (21,)), (-1, ())]
    assert by_choice(got) == by_choice(outs)
    assert got[1].finish_reason == "length" and got[0].finish_reason is None


def test_the_final_output_is_never_merged_into_or_across() -> None:
    assert coalesce([FINAL]) == [FINAL]
    assert coalesce([delta(0, 1, finish="stop"), FINAL]) == [delta(0, 1, finish="stop"), FINAL]
    # (Nothing follows the final output; were something to, it would stay after it.)
    late = delta(0, 2)
    assert coalesce([delta(0, 1), FINAL, late]) == [delta(0, 1), FINAL, late]
    assert merge(delta(0, 1), FINAL) is None and merge(FINAL, delta(0, 1)) is None


def test_a_finish_ends_a_run() -> None:
    end = delta(0, 1, 2, finish="stop", stop_reason="xy")
    after = delta(0, 3)  # (the processor drops these; were one to come, it stays after the end)
    assert coalesce([end, after]) == [end, after]
    assert coalesce([delta(0, 1), end, after, FINAL])[0].stop_reason == "xy"
    failed = RequestOutput("r", 0, finish_reason="error", error="boom")
    got = coalesce([delta(0, 1), failed, FINAL])
    assert len(got) == 2 and (got[0].finish_reason, got[0].error, got[0].token_ids) == ("error", "boom", (1,))


def test_logprobs_stay_aligned_with_token_ids() -> None:
    with_lps, without = delta(0, 1), delta(0, 2, logprobs=False)
    assert coalesce([with_lps, without]) == [with_lps, without]  # merged, logprobs would miss token 2
    assert coalesce([without, with_lps]) == [without, with_lps]
    plain = coalesce([delta(0, 1, logprobs=False), delta(0, 2, logprobs=False)])
    assert plain == [RequestOutput("r", 0, (1, 2), "bc", weights_version="v1")]
    # An abort after tokens with logprobs: no tokens, no logprobs; merges.
    aborted = RequestOutput("r", 0, finish_reason="abort")
    (got,) = coalesce([with_lps, aborted])
    assert got.logprobs == with_lps.logprobs and got.finish_reason == "abort"
    for out in coalesce([delta(0, 1), delta(0, 2, 3), delta(0, 4), delta(1, 5)]):
        assert out.logprobs is not None and [e.token_id for e in out.logprobs] == list(out.token_ids)


def test_prompt_logprobs_stay_on_the_first_delta() -> None:
    scores = (None, TokenLogprob(7, -1.0, (), rank=1))
    first = RequestOutput("r", 0, prompt_logprobs=scores)  # (before the choice's first token, no version)
    got = coalesce([first, delta(0, 1), delta(0, 2), FINAL])
    assert got[0] == RequestOutput("r", 0, (1, 2), "bc", (lp(1), lp(2)), prompt_logprobs=scores, weights_version="v1")
    # A delta with prompt logprobs after tokens would move them: it stays apart.
    assert len(coalesce([delta(0, 1), first])) == 2


def test_embeddings_usage_and_weight_versions_keep_apart() -> None:
    vector = RequestOutput("r", 0, finish_reason="stop", embedding=b"\0\0\0\0")
    assert coalesce([RequestOutput("r", 0), vector]) == [RequestOutput("r", 0), vector]
    assert merge(vector, delta(0, 1)) is None
    assert merge(delta(0, 1), RequestOutput("r", 0, (2,), usage=Usage(1, 1))) is None
    # A live update cut over between two deltas: each version keeps its tokens.
    old, new = delta(0, 1), delta(0, 2, weights_version="v2")
    assert coalesce([old, new]) == [old, new]
    assert coalesce([old, delta(0, 2), new])[0].token_ids == (1, 2)
    assert merge(delta(0, 1), RequestOutput("r", 0, finish_reason="abort")).weights_version == "v1"  # type: ignore[union-attr]


def test_tagged_outputs_merge_only_within_their_stream() -> None:
    a, b = delta(0, 1), delta(0, 2)  # (same request id and choice, other streams)
    items = [(0, a), (1, b), (0, delta(0, 3)), (1, delta(0, 4)), (0, FINAL), (1, FINAL)]
    got = coalesce_tagged(items)
    assert [(tag, o.token_ids) for tag, o in got] == [(0, (1, 3)), (1, (2, 4)), (0, ()), (1, ())]
    # One stream's final output does not stop another's deltas merging across it.
    got = coalesce_tagged([(0, a), (1, b), (1, FINAL), (0, delta(0, 5)), (0, FINAL)])
    assert [(tag, o.token_ids) for tag, o in got] == [(0, (1, 5)), (1, (2,)), (1, ()), (0, ())]


def test_random_interleavings_keep_every_choices_content() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 3)
        per_choice: list[list[RequestOutput]] = []
        for c in range(n):
            k = rng.randint(1, 5)
            ds = [
                delta(c, *rng.sample(range(50), rng.randint(0, 3)), weights_version=rng.choice(["v1", "v2"]))
                for _ in range(k)
            ]
            ds[-1] = delta(c, *ds[-1].token_ids, finish="stop", weights_version=ds[-1].weights_version)
            per_choice.append(ds)
        outs = []
        while any(per_choice):
            outs.append(rng.choice([d for d in per_choice if d]).pop(0))
        outs.append(FINAL)
        got = coalesce(outs)
        assert by_choice(got) == by_choice(outs)
        assert got[-1] is FINAL and len(got) <= len(outs)
        for i, out in enumerate(got):  # each choice's finish on its last output, versions kept in order
            assert out.finish_reason is None or all(o.choice != out.choice for o in got[i + 1 :])
        for c in range(n):
            versions = [o.weights_version for o in outs if o.choice == c]
            merged_versions = [o.weights_version for o in got if o.choice == c]
            assert [v for i, v in enumerate(versions) if i == 0 or versions[i - 1] != v] == merged_versions


# -- RequestStream and merged --------------------------------------------------------------------
def test_an_async_stream_gives_a_slow_consumer_fewer_merged_outputs() -> None:
    async def run() -> tuple[list[RequestOutput], list[RequestOutput]]:
        stream = RequestStream("r")
        sent = [delta(0, 1), delta(1, 11), delta(0, 2, 3), delta(1, 12, finish="length")]
        RequestStream.put_many([(stream, o) for o in sent])  # (in the loop: queued at once)
        got = []
        reader = aiter(stream)
        got.append(await anext(reader))  # the consumer catches up: two choices, two outputs
        got.append(await anext(reader))
        more = [delta(0, 4), delta(0, 5, finish="stop"), FINAL]
        for o in more:
            stream.put(o)  # (call_soon_threadsafe, as from the engine thread)
        await asyncio.sleep(0)  # the loop delivers them before the consumer reads again
        got += [o async for o in reader]
        return sent + more, got

    sent, got = asyncio.run(run())
    assert [(o.choice, o.token_ids) for o in got] == [(0, (1, 2, 3)), (1, (11, 12)), (0, (4, 5)), (-1, ())]
    assert by_choice(got) == by_choice(sent)
    assert got[-1] == FINAL


def test_a_consumer_that_keeps_up_gets_every_delta_as_sent() -> None:
    async def run() -> list[RequestOutput]:
        stream = RequestStream("r")
        got = []
        reader = aiter(stream)
        for o in [delta(0, 1), delta(0, 2), FINAL]:
            stream.put(o)
            got.append(await anext(reader))
        return got

    assert asyncio.run(run()) == [delta(0, 1), delta(0, 2), FINAL]


def test_a_plain_stream_coalesces_too() -> None:
    stream = RequestStream("r")  # (outside a loop: a blocking queue)
    sent = [delta(0, 1), delta(0, 2), delta(0, 3, finish="stop"), FINAL]
    for o in sent:
        stream.put(o)
    got = list(stream)
    assert got == [delta(0, 1, 2, 3, finish="stop"), FINAL] and stream.finished


def test_merged_streams_coalesce_per_stream() -> None:
    async def run() -> list[tuple[int, RequestOutput]]:
        streams = [RequestStream("r-0"), RequestStream("r-1")]
        for i, s in enumerate(streams):
            for o in [delta(0, 1 + i), delta(0, 10 + i), delta(0, 20 + i, finish="stop"), FINAL]:
                s.put(o)
        await asyncio.sleep(0)  # every output delivered before the consumer reads
        return [item async for item in merged(streams)]

    got = asyncio.run(run())
    tokens = {i: [t for j, o in got if j == i for t in o.token_ids] for i in (0, 1)}
    assert tokens == {0: [1, 10, 20], 1: [2, 11, 21]}
    assert len(got) == 4 and [o.final for _, o in got].count(True) == 2
    assert sorted(i for i, o in got if o.final) == [0, 1]
    for i in (0, 1):  # each stream's final output after its deltas
        mine = [o for j, o in got if j == i]
        assert mine[-1].final and mine[0].finish_reason == "stop"
