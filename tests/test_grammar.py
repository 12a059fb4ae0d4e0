"""Grammar-constrained decoding, host side (``grammar.py``) and the device's mask application.

Real llguidance grammars over SmolLM2's real tokenizer (the bundled GGUF's): a valid document's
tokens are each allowed by the mask at their position, invalid continuations are masked out, and
bad constraints raise an error that names the problem. No device work beyond one jitted mask.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from myserve.bundled import bundled_gguf_path
from myserve.grammar import GrammarMatcher, Grammars, GrammarSpec, InvalidGrammar, allocate_bitmask, fill_bitmask
from myserve.runtime.sampler import apply_token_bitmask
from myserve.tokenizer import Tokenizer

VOCAB = 49152

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["city", "unit", "days", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(bundled_gguf_path())


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars(tokenizer.hf, VOCAB, tokenizer.eos_token_ids)


def allowed(grammars: Grammars, matcher: GrammarMatcher) -> np.ndarray:
    """The token ids the matcher allows next."""
    mask = allocate_bitmask(1, VOCAB)
    fill_bitmask([(matcher, 0)], mask)
    bits = (mask[0][:, None] >> np.arange(32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:VOCAB])


def walk(grammars: Grammars, matcher: GrammarMatcher, ids: list[int]) -> None:
    """Feed ``ids``, checking that the mask allowed each before it was accepted."""
    for i, token in enumerate(ids):
        assert token in allowed(grammars, matcher), f"token {i} ({token}) was masked out"
        assert matcher.accept(token), matcher.error


def test_a_valid_document_passes_token_by_token_and_then_only_eos(grammars: Grammars, tokenizer: Tokenizer) -> None:
    matcher = grammars.matcher(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    document = '{"city": "Paris", "unit": "celsius", "days": 3, "tags": ["a", "bc"]}'  # the compact form
    walk(grammars, matcher, tokenizer.encode(document))
    assert matcher.accepting
    assert set(allowed(grammars, matcher).tolist()) <= set(tokenizer.eos_token_ids)


def test_invalid_continuations_are_masked_out(grammars: Grammars, tokenizer: Tokenizer) -> None:
    matcher = grammars.matcher(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    walk(grammars, matcher, tokenizer.encode('{"city": "'))
    ok = allowed(grammars, matcher)
    lower = tokenizer.encode("paris")[0]  # the pattern wants a capital first
    assert lower not in ok and tokenizer.encode("Paris")[0] in ok
    walk(grammars, matcher, tokenizer.encode('Paris", "unit": "'))
    texts = {tokenizer.decode([t]) for t in allowed(grammars, matcher)}
    assert texts and all("celsius".startswith(t) or "fahrenheit".startswith(t) for t in texts)


def test_json_object_regex_and_choice(grammars: Grammars, tokenizer: Tokenizer) -> None:
    obj = grammars.matcher(GrammarSpec("json_object", ""))
    assert tokenizer.encode("[")[0] not in allowed(grammars, obj)  # an object, not any JSON value
    walk(grammars, obj, tokenizer.encode('{"a": [1, 2]}'))
    assert obj.accepting
    choice = grammars.matcher(GrammarSpec("choice", '["yes", "no"]'))
    assert {tokenizer.decode([t]) for t in allowed(grammars, choice)} <= {"y", "ye", "yes", "n", "no"}
    regex = grammars.matcher(GrammarSpec("regex", r"[0-9]{3}-[0-9]{4}"))
    walk(grammars, regex, tokenizer.encode("555-1234"))
    assert regex.finished


def test_lark_and_gbnf_grammars(grammars: Grammars, tokenizer: Tokenizer) -> None:
    lark = grammars.matcher(GrammarSpec("grammar", 'start: "a" "b"+'))
    walk(grammars, lark, tokenizer.encode("abbb"))
    gbnf = grammars.matcher(GrammarSpec("grammar", 'root ::= "x" [0-9]+'))
    walk(grammars, gbnf, tokenizer.encode("x42"))
    assert tokenizer.encode("y")[0] not in allowed(grammars, grammars.matcher(GrammarSpec("grammar", 'root ::= "x"')))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("json_schema", '{"type": "strng"}'), "strng"),
        (GrammarSpec("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (GrammarSpec("json_schema", "{not json"), "json_schema"),
        (GrammarSpec("regex", "a(b"), "regex"),
        (GrammarSpec("choice", "[]"), "non-empty list of strings"),
        (GrammarSpec("grammar", "start: undefined_rule"), "undefined_rule"),
    ],
)
def test_bad_constraints_name_the_problem(grammars: Grammars, spec: GrammarSpec, message: str) -> None:
    with pytest.raises(InvalidGrammar, match=message):
        grammars.validate(spec)


def test_fork_and_rollback(grammars: Grammars, tokenizer: Tokenizer) -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    matcher = grammars.matcher(spec)
    walk(grammars, matcher, tokenizer.encode('{"city": "'))
    at_city = allowed(grammars, matcher)
    twin = matcher.fork()
    walk(grammars, matcher, tokenizer.encode("Rome"))
    np.testing.assert_array_equal(allowed(grammars, twin), at_city)  # the fork did not move
    matcher.rollback(len(tokenizer.encode("Rome")))
    np.testing.assert_array_equal(allowed(grammars, matcher), at_city)  # back where it forked
    fresh = grammars.matcher(spec)  # the cached template is untouched by its copies
    assert tokenizer.encode('{"city')[0] in allowed(grammars, fresh)


def test_apply_token_bitmask_leaves_exactly_the_allowed_tokens(grammars: Grammars, tokenizer: Tokenizer) -> None:
    matchers = [
        grammars.matcher(GrammarSpec("choice", '["yes", "no"]')),
        grammars.matcher(GrammarSpec("json_object", "")),
    ]
    mask = allocate_bitmask(3, VOCAB)  # row 2 stays unconstrained
    fill_bitmask([(m, row) for row, m in enumerate(matchers)], mask)
    logits = jax.random.normal(jax.random.key(0), (3, VOCAB))
    out = np.asarray(jax.jit(apply_token_bitmask)(logits, jnp.asarray(mask)))
    for row, m in enumerate(matchers):
        kept = np.flatnonzero(np.isfinite(out[row]))
        np.testing.assert_array_equal(kept, allowed(grammars, m))
        np.testing.assert_array_equal(out[row, kept], np.asarray(logits)[row, kept])
    np.testing.assert_array_equal(out[2], np.asarray(logits)[2])
