"""``allowed_token_ids`` and ``bad_words`` as bitmask rows (host logic, no device), and the front
end's tokenization of bad words as vLLM does it."""

from __future__ import annotations

import numpy as np

from myserve.bundled import bundled_gguf_path
from myserve.core.token_masks import TokenFilter
from myserve.frontend.generation import _bad_words_ids
from myserve.grammar import allocate_bitmask
from myserve.tokenizer import Tokenizer
from myserve.wire.params import SamplingParams

VOCAB = 100


def allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
    return {int(t) for t in np.flatnonzero(bits)}


def mask(params: SamplingParams, output: list[int], row: np.ndarray | None = None) -> set[int]:
    row = allocate_bitmask(1, VOCAB)[0] if row is None else row
    TokenFilter(params, VOCAB).apply(row, output)
    return allowed(row)


def test_allowed_token_ids_is_a_fixed_row() -> None:
    params = SamplingParams(allowed_token_ids=(0, 31, 32, 63, 99))
    assert mask(params, []) == {0, 31, 32, 63, 99}
    assert mask(params, [5, 6, 7]) == {0, 31, 32, 63, 99}


def test_a_bad_word_bans_its_last_token_after_its_prefix() -> None:
    params = SamplingParams(bad_words_ids=((7,), (10, 11, 12)))
    everything = set(range(VOCAB))
    assert mask(params, []) == everything - {7}  # a one-token word: always banned
    assert mask(params, [3, 10]) == everything - {7}  # the prefix is not complete yet
    assert mask(params, [3, 10, 11]) == everything - {7, 12}
    assert mask(params, [10, 11, 4]) == everything - {7}


def test_a_mask_left_empty_keeps_the_grammars_row() -> None:
    row = np.zeros(-(-VOCAB // 32), np.int32)
    row[0] = 1 << 5  # a grammar allowing token 5 only
    assert mask(SamplingParams(allowed_token_ids=(6,)), [], row) == {5}
    row[0] = (1 << 5) | (1 << 6)
    assert mask(SamplingParams(allowed_token_ids=(6,)), [], row) == {6}


def test_bad_words_are_tokenized_bare_and_after_a_space() -> None:
    tok = Tokenizer.load(bundled_gguf_path())

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    ids = _bad_words_ids(["hello", " world peace"], encode)
    assert tuple(encode("hello")) in ids and tuple(encode(" hello")) in ids
    assert tuple(encode("world peace")) in ids
    assert all(ids.count(w) == 1 for w in ids)
