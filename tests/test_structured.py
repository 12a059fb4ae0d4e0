"""Grammar-constrained generation through the engine: a tiny random Llama with SmolLM2's vocabulary
(so its tokens are the tokenizer's), sampling at temperature 1, must still emit documents that parse
and validate, over HTTP too, streamed or not; free requests in the same batch are unaffected;
nothing compiles for constrained requests; choices, preemption and a grammar that starts after a
marker keep each sequence's grammar; a bad constraint is refused."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
from test_server import LiveServer

from myserve.frontend.app import create_app
from myserve.grammar import GrammarSpec
from myserve.runtime.compile_counter import compile_count
from myserve.testing import NESTED_SCHEMA, TINY_ENGINE, collect, make_tiny_checkpoint, start_service, streamed_and_not
from myserve.wire.params import InvalidParams, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
    },
    "required": ["city", "unit", "days", "ok", "tags", "code"],
    "additionalProperties": False,
}
PROMPTS = [[(13 * i + 7 * j) % 5000 + 100 for j in range(4 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory):
    checkpoint = make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("vocab") / "llama", vocab_size=49152)
    svc = start_service(Path(checkpoint), *TINY_ENGINE, "engine.num_pages=256")
    yield svc
    svc.shutdown()


def constrained(seed: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=120, temperature=1.0, seed=seed, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))
    )


def test_sampled_documents_parse_and_validate(service) -> None:
    streams = [service.submit(PROMPTS[i % len(PROMPTS)], constrained(seed)) for i, seed in enumerate(range(12))]
    for stream in streams:
        _, text, finish = collect(stream)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_free_requests_are_unaffected_by_constrained_ones(service) -> None:
    free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = [collect(service.submit(p, free))[0] for p in PROMPTS[:3]]
    streams = [service.submit(p, constrained(i)) for i, p in enumerate(PROMPTS[3:])]
    mixed = [service.submit(p, free) for p in PROMPTS[:3]]
    assert [collect(s)[0] for s in mixed] == alone
    for s in streams:
        jsonschema.validate(json.loads(collect(s)[1]), SCHEMA)


def test_a_bad_constraint_is_refused_at_submit(service) -> None:
    bad = SamplingParams(grammar=GrammarSpec("json_schema", '{"type": "array", "uniqueItems": true}'))
    with pytest.raises(InvalidParams, match="uniqueItems"):
        service.submit(PROMPTS[0], bad)
    endless = SamplingParams(ignore_eos=True, grammar=GrammarSpec("regex", "[0-9]+"))
    with pytest.raises(InvalidParams, match="ignore_eos"):
        service.submit(PROMPTS[0], endless)


def test_fifty_seeded_schema_requests_over_http_validate_and_stream_the_same(service) -> None:
    server = LiveServer(create_app(service, served_model_name="tiny"))
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": NESTED_SCHEMA, "strict": True}}
    clients: list[openai.AsyncOpenAI] = []

    def client() -> openai.AsyncOpenAI:  # made inside the event loop that uses it
        if not clients:
            clients.append(openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600))
        return clients[0]

    async def one(client: openai.AsyncOpenAI, seed: int, stream: bool) -> tuple[str, str | None]:
        kw = dict(model="tiny", prompt=f"Person #{seed}:", temperature=1.0, seed=seed, max_tokens=200)
        kw["extra_body"] = {"response_format": fmt}  # a vLLM-style extra on completions
        if not stream:
            r = await client.completions.create(**kw)
            return r.choices[0].text, r.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await client.completions.create(stream=True, **kw):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    assert service.replicas[0].runner.device.background_builds_done(600)  # (decode calls: built after ready)
    compiled = compile_count()
    try:
        full, parts = streamed_and_not(lambda seed, stream: one(client(), seed, stream), 50)
    finally:
        server.stop()
    assert compile_count() == compiled, "constrained requests compiled something after warmup"
    for text, finish in full:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), NESTED_SCHEMA)
    assert parts == full


def test_choices_and_preemption_keep_each_sequence_grammar(service) -> None:
    """Eight 3-choice requests of 300 digits (one token each) outgrow the 256 pages of 8 tokens:
    sequences are preempted and recomputed, and every choice still matches its regex exactly."""
    before = service.stats().num_preemptions
    params = SamplingParams(max_tokens=400, temperature=1.0, n=3, grammar=GrammarSpec("regex", "[0-9]{300}"))
    streams = [service.submit(PROMPTS[i % len(PROMPTS)], dataclasses.replace(params, seed=i)) for i in range(8)]
    for stream in streams:
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        for out in stream:
            if out.final:
                continue
            texts[out.choice] = texts.get(out.choice, "") + out.text
            if out.finish_reason:
                finishes[out.choice] = out.finish_reason
        assert sorted(texts) == [0, 1, 2] and set(finishes.values()) == {"stop"}
        assert all(re.fullmatch("[0-9]{300}", t) for t in texts.values()), texts
        assert len(set(texts.values())) == 3, "the choices are sampled independently"
    assert service.stats().num_preemptions > before


def test_a_grammar_after_a_marker_leaves_the_output_free_until_then(service) -> None:
    """The marker token is pushed by a bias (the output is free, so it is sampled first); once it
    is out, the grammar masks everything but its choices, bias or not."""
    marker = 1234
    params = SamplingParams(
        max_tokens=20,
        temperature=1.0,
        seed=3,
        logit_bias=((marker, 100.0),),
        grammar=GrammarSpec("choice", '["yes", "no"]'),
        grammar_after=(marker,),
    )
    tokens, text, finish = collect(service.submit(PROMPTS[0], params))
    assert tokens[0] == marker and finish == "stop"
    rest = service.tokenizer.decode(tokens[1:])
    assert rest in ("yes", "no"), (tokens, text)
    with pytest.raises(InvalidParams, match="grammar_after"):
        SamplingParams(grammar_after=(marker,))
