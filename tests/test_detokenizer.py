"""Incremental detokenization on byte-level BPE (the bundled SmolLM2) and SentencePiece-style vocabularies.

The SentencePiece tokenizers are trained here on a tiny corpus (no downloads): a BPE model with byte
fallback behind a Metaspace pre-tokenizer, with llama-2's decoder (``Replace ▁``, ``ByteFallback``,
``Fuse``, ``Strip`` one leading space) or a ``Metaspace`` decoder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from myserve.bundled import bundled_gguf_path
from myserve.frontend.detokenizer import IncrementalDetokenizer, token_bytes
from myserve.tokenizer import Tokenizer

IM_START, IM_END = 1, 2  # SmolLM2's chat markers, both special
TEXTS = [
    "Hello world",
    "🦙🚀",
    "日本語のテキスト",
    "café naïve Ångström",
    "Mixed: 🦙 llamas\n  and 日本語,\n\ncafé 🚀!",
    " leading space and trailing \n",
]
SP_CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. Say hello to the world.",
    "llamas and rockets and text in many languages",
]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    """The bundled SmolLM2 GGUF's byte-level BPE tokenizer, loaded once."""
    return Tokenizer.load(bundled_gguf_path())


def _train_sentencepiece_style(decoder: str) -> PreTrainedTokenizerFast:
    """A llama-like BPE + byte-fallback tokenizer: accents, CJK and emoji all fall back to ``<0xNN>``."""
    rust = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = [*"abcdefghijklmnopqrstuvwxyzHST,.", "▁"]
    trainer = trainers.BpeTrainer(
        vocab_size=150,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    rust.train_from_iterator(SP_CORPUS, trainer)
    # Put the 256 byte tokens into the model's vocabulary (not as added tokens, which decode differently).
    state = json.loads(rust.to_str())
    vocab = {name: i for i, name in enumerate(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))])}
    for name, _ in sorted(state["model"]["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(name, len(vocab))
    state["model"]["vocab"] = vocab
    for added in state["added_tokens"]:
        added["id"] = vocab[added["content"]]
    rust = RustTokenizer.from_str(json.dumps(state))
    if decoder == "llama":
        rust.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        rust.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace("▁", prepend_scheme="first")])
    return PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def sp(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer with the decoder named by the parameter."""
    return _train_sentencepiece_style(request.param)


def stream(
    hf: PreTrainedTokenizerFast, ids: Sequence[int], prompt: Sequence[int] = (), *, skip_special_tokens: bool = True
) -> list[str]:
    """The deltas of streaming ``ids`` one token at a time, checking the invariants at every step."""
    detok = IncrementalDetokenizer(hf, prompt, skip_special_tokens=skip_special_tokens)
    deltas = []
    for i, token_id in enumerate(ids):
        deltas.append(detok.add([token_id]))
        assert detok.text == "".join(deltas)
        assert len(detok._tokens) <= 8  # the window stays small: each step decodes a few tokens only
        expected = in_context(hf, prompt, ids[: i + 1], skip_special_tokens)
        if not expected.endswith("\ufffd"):
            assert detok.text == expected
    deltas.append(detok.finish())
    assert "".join(deltas) == in_context(hf, prompt, ids, skip_special_tokens)
    full = hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in full
    return deltas


def token_id(hf: PreTrainedTokenizerFast, token: str) -> int:
    """The id of a vocabulary token that must exist."""
    found = hf.convert_tokens_to_ids(token)
    assert isinstance(found, int) and found != hf.unk_token_id
    return found


def in_context(hf: PreTrainedTokenizerFast, prompt: Sequence[int], ids: Sequence[int], skip: bool) -> str:
    """The text ``ids`` have after ``prompt``."""
    before = str(hf.decode(list(prompt), skip_special_tokens=skip))
    after = str(hf.decode([*prompt, *ids], skip_special_tokens=skip))
    assert after.startswith(before)
    return after[len(before) :]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_stream_equals_decode(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text, add_special_tokens=False)
    assert "".join(stream(smol.hf, ids)) == smol.decode(ids) == text
    # byte-level BPE needs no context: after a prompt the text is the same
    prompt = smol.apply_chat_template([{"role": "user", "content": "Say something"}])
    assert "".join(stream(smol.hf, ids, prompt)) == text


def test_byte_level_batches_and_split_characters(smol: Tokenizer) -> None:
    ids = smol.encode("a🦙b 日本", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, [])
    first = detok.add(ids[:2])  # "a" and the first half of the llama
    assert first == "a"
    assert detok.add(ids[2:]) + detok.finish() == "🦙b 日本"
    # output ending mid-character (max_tokens, EOS, a stop token): the incomplete bytes are dropped
    detok = IncrementalDetokenizer(smol, [])
    assert detok.add(ids[:2]) == "a"
    assert smol.decode(ids[1:2]) == "\ufffd"
    assert detok.finish() == "" and detok.text == "a"


def test_cut_after_complete_characters_keeps_them(smol: Tokenizer) -> None:
    llama = smol.encode("🦙", add_special_tokens=False)
    assert len(llama) > 1
    detok = IncrementalDetokenizer(smol, [])
    # a whole llama, then the start of a second one, all in one batch
    text = detok.add([*smol.encode("x🦙", add_special_tokens=False), *llama[:-1]]) + detok.finish()
    assert text == detok.text == "x🦙"


def test_byte_level_special_tokens(smol: Tokenizer) -> None:
    ids = [*smol.encode("Hi", add_special_tokens=False), IM_END, *smol.encode(" there 🦙", add_special_tokens=False)]
    assert "".join(stream(smol.hf, ids)) == "Hi there 🦙"
    assert "".join(stream(smol.hf, ids, skip_special_tokens=False)) == "Hi<|im_end|> there 🦙"
    assert "".join(stream(smol.hf, [IM_START, IM_END])) == ""


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_stream_equals_decode(sp: PreTrainedTokenizerFast, text: str) -> None:
    ids = sp.encode(text, add_special_tokens=False)
    assert any(t.startswith("<0x") for t in sp.convert_ids_to_tokens(ids)) or text == "Hello world"
    assert "".join(stream(sp, ids)) == sp.decode(ids)


def test_sentencepiece_leading_space_after_prompt(sp: PreTrainedTokenizerFast) -> None:
    prompt = sp.encode("Say hello to the", add_special_tokens=False)
    ids = sp.encode("world 🦙🚀", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(ids)[0].startswith("▁")
    # decoded alone the first token loses its space; after the prompt it must keep it
    assert sp.decode(ids) == "world 🦙🚀"
    deltas = stream(sp, ids, prompt)
    assert deltas[0] == " world"
    assert "".join(deltas) == " world 🦙🚀"
    # with only special tokens before it, the first token starts the text: no space
    assert "".join(stream(sp, ids, [sp.bos_token_id])) == "world 🦙🚀"


def test_sentencepiece_special_tokens(sp: PreTrainedTokenizerFast) -> None:
    ids = [sp.bos_token_id, *sp.encode("Hello 日本", add_special_tokens=False), sp.eos_token_id]
    assert "".join(stream(sp, ids)) == "Hello 日本"
    assert "".join(stream(sp, ids, skip_special_tokens=False)) == sp.decode(ids, skip_special_tokens=False)


def test_sentencepiece_cut_inside_a_character(sp: PreTrainedTokenizerFast) -> None:
    ids = sp.encode("Hello 日本", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(ids)[-1].startswith("<0x")  # 本 is three byte-fallback tokens
    for cut in (1, 2):
        detok = IncrementalDetokenizer(sp, [])
        text = detok.add(ids[:-cut]) + detok.finish()
        assert sp.decode(ids[:-cut]).endswith("\ufffd")
        assert text == detok.text == "Hello 日"


def test_invalid_bytes_do_not_stall(sp: PreTrainedTokenizerFast) -> None:
    stray = token_id(sp, "<0x80>")  # a continuation byte with no lead byte: never valid
    ids = [stray] * 40 + sp.encode("ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(sp, [])
    deltas = [detok.add([t]) for t in ids]
    assert any(deltas[:40])  # released after a bounded wait
    assert "".join(deltas) + detok.finish() == sp.decode(ids)
    # invalid bytes inside the text are passed on as U+FFFD; at the end they are dropped
    detok = IncrementalDetokenizer(sp, [])
    middle = [*ids[40:], stray, *ids[40:]]
    text = detok.add([*middle, stray, stray]) + detok.finish()
    assert text == sp.decode(middle) and "\ufffd" in text and not text.endswith("\ufffd")


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet="ab é日本🦙 \n", max_size=24))
def test_random_texts_stream_exactly(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text, add_special_tokens=False)
    assert "".join(stream(smol.hf, ids)) == smol.decode(ids)


def test_token_bytes_byte_level(smol: Tokenizer) -> None:
    for text in TEXTS:
        ids = smol.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(smol, t) for t in ids) == text.encode()
    ids = smol.encode(" 日", add_special_tokens=False)
    assert smol.convert_ids_to_tokens(ids)[0] == "Ġæ"
    assert token_bytes(smol, ids[0]) == b" \xe6"
    assert token_bytes(smol.hf, smol.encode("Hello", add_special_tokens=False)[0]) == b"Hello"
    assert token_bytes(smol, IM_END) == b"<|im_end|>"
    with pytest.raises(ValueError):
        token_bytes(smol, 10**9)


def test_token_bytes_sentencepiece(sp: PreTrainedTokenizerFast) -> None:
    assert token_bytes(sp, token_id(sp, "<0xF0>")) == b"\xf0"
    assert token_bytes(sp, token_id(sp, "<0x0A>")) == b"\n"
    assert token_bytes(sp, token_id(sp, "▁the")) == b" the"
    assert token_bytes(sp, sp.eos_token_id) == b"</s>"
    text = "café 🦙\n日本"
    ids = sp.encode(text, add_special_tokens=False)
    # the Metaspace pre-tokenizer prepends the space marker to the first word
    assert b"".join(token_bytes(sp, t) for t in ids) == (" " + text).encode()
