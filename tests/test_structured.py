"""Grammar-constrained generation through the engine: a tiny random Llama with SmolLM2's vocabulary
(so its tokens are the tokenizer's), sampling at temperature 1, must still emit documents that parse
and validate; free requests in the same batch are unaffected; a bad constraint is refused."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from myserve.engine.grammar import GrammarSpec
from myserve.engine.params import InvalidParams, SamplingParams
from myserve.testing import TINY_ENGINE, collect, make_tiny_checkpoint, start_service

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
