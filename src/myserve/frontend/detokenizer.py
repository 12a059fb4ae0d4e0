"""Incremental detokenization: generated token ids -> text deltas, per sequence, on the host.

Decoding one token at a time is wrong in two ways: a character can be split across tokens (byte-level
BPE spells an emoji as two or three tokens, SentencePiece as ``<0xF0><0x9F>...`` byte-fallback tokens),
and SentencePiece decoders drop the leading space of the *first* token they see (``Strip`` or
``Metaspace``), so a token decoded alone loses its space. Re-decoding the whole output every step is
right but quadratic. So, as vLLM and TGI do, we keep a small window of token ids: a *prefix* part that
was already emitted (context only) and a *read* part not yet emitted, and emit
``decode(prefix + read)[len(decode(prefix)):]``. The read part is held back while its text ends in
U+FFFD (an incomplete character), and once emitted it becomes the next prefix, so the window stays a few
tokens long. When the sequence ends inside a character (max_tokens, EOS, a stop token), the incomplete
bytes are dropped, as vLLM does: no output ends in a U+FFFD that only stands for a cut character.

Token ids are decoded with the Rust ``tokenizers`` backend directly: that is what
``PreTrainedTokenizerFast.decode`` calls, without its per-call Python overhead. Its
``clean_up_tokenization_spaces`` pass (off for our tokenizers, and skipped by transformers for BPE
vocabularies) is not applied, because it rewrites text across token boundaries and cannot be streamed.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from myserve.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5
"""Prompt tokens kept as context for the first output token (vLLM's initial offset)."""
_MAX_PENDING = 32
"""Held-back tokens after which text is emitted even if it ends in U+FFFD.

A real character needs at most four tokens (one byte each); more means the model is producing invalid
bytes, and waiting longer would only make every step re-decode a growing window.
"""
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas, holding back split characters.

    The deltas concatenate to the text the generated tokens have *in context*, i.e. after the prompt:
    ``decode(prompt + output)[len(decode(prompt)):]``. For byte-level BPE that is exactly
    ``decode(output)``; for SentencePiece it differs only in keeping the leading space of the first
    output token, which ``decode(output)`` alone strips. The equality holds whenever the output does not
    end in an incomplete UTF-8 sequence; after :meth:`finish` it holds up to that sequence, which is
    dropped rather than ending the text in U+FFFD. (Invalid byte sequences inside the text, which no
    real text produces, are passed on best effort as U+FFFD: SentencePiece's byte fallback turns a whole
    run of bytes into U+FFFDs once any byte of it is invalid, which would retract text already emitted.)
    """

    def __init__(
        self,
        tokenizer: Tokenizer | PreTrainedTokenizerFast,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        hf = _hf(tokenizer)
        self._backend: Any = hf.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        """Whether special tokens (BOS, EOS, chat markers) are left out of the text."""
        # decode(skip_special_tokens=True) drops special ids before its decoder runs, so dropping them
        # here gives the same text and keeps them out of the window.
        self._skipped = _info(hf).special_ids if skip_special_tokens else frozenset()
        context = [t for t in prompt_ids if t not in self._skipped][-_PROMPT_CONTEXT:]
        self._tokens: list[int] = context
        """The window: ``[:_read]`` is emitted (context), ``[_read:]`` is held back."""
        self._read = len(context)
        self._prefix_text = self._decode(context)
        """``decode(self._tokens[:self._read])``, the text the new tokens' text must extend."""
        self.text = ""
        """All text emitted so far."""

    def add(self, token_ids: Sequence[int]) -> str:
        """Take newly generated token ids; return the text they complete (possibly empty)."""
        deltas = []
        # One step per token, so that a batch of tokens ending in half a character still emits the
        # complete characters before it now.
        for token_id in token_ids:
            if token_id in self._skipped:
                continue
            self._tokens.append(token_id)
            deltas.append(self._step(final=False))
        return "".join(deltas)

    def finish(self) -> str:
        """Release held-back text at the end of the sequence, less a trailing incomplete character.

        The held part ends in U+FFFD only when the sequence stopped inside a character (or on invalid
        bytes): those U+FFFDs are dropped, so streamed and whole outputs agree and neither ends in one.
        A genuine U+FFFD character at the very end cannot be told apart in decoded text and goes too.
        """
        return self._step(final=True) if self._read < len(self._tokens) else ""

    def _step(self, *, final: bool) -> str:
        text = self._decode(self._tokens)
        held = len(self._tokens) - self._read
        incomplete = text.endswith(_REPLACEMENT) or len(text) <= len(self._prefix_text)
        if incomplete and not final and held < _MAX_PENDING:
            return ""
        # text starts with _prefix_text for valid UTF-8; the slice is the best effort otherwise.
        delta = text[len(self._prefix_text) :]
        if final:
            delta = delta.rstrip(_REPLACEMENT)
        # The tokens just read become the context of the next ones; older ones are no longer needed.
        del self._tokens[: self._read]
        self._read = len(self._tokens)
        self._prefix_text = self._decode(self._tokens)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return str(self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens))


def token_bytes(tokenizer: Tokenizer | PreTrainedTokenizerFast, token_id: int) -> bytes:
    """The raw bytes one token stands for (for logprobs' ``bytes``), even when they are not valid UTF-8.

    Byte-level BPE: the GPT-2 byte-to-unicode map reversed (``Ġ`` -> space, ``æ`` -> ``0xE6``...).
    SentencePiece: ``▁`` -> space and ``<0xNN>`` byte-fallback tokens -> that byte. Added and special
    tokens: their text. Other vocabularies: the UTF-8 of the token decoded alone.
    """
    hf = _hf(tokenizer)
    info = _info(hf)
    added = info.added.get(token_id)
    if added is not None:
        return added.encode()
    token = hf.backend_tokenizer.id_to_token(token_id)
    if token is None:
        raise ValueError(f"token id {token_id} is not in the vocabulary")
    if info.kind == "byte_level":
        try:
            return bytes(_UNICODE_TO_BYTE[c] for c in token)
        except KeyError:  # as the ByteLevel decoder: a token outside the map stands for its own UTF-8
            return token.encode()
    if info.kind == "sentencepiece":
        if info.byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:  # "<0xZZ>" is an ordinary token that only looks like a byte
                pass
        return token.replace(info.space, " ").encode()
    return str(hf.decode([token_id], skip_special_tokens=False)).encode()


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (as ``tokenizers``' ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


_UNICODE_TO_BYTE = {c: b for b, c in _gpt2_bytes_to_unicode().items()}


@dataclass(frozen=True)
class _VocabInfo:
    """What detokenization needs to know about one tokenizer, worked out once."""

    special_ids: frozenset[int]
    """Ids that ``skip_special_tokens`` drops."""
    added: dict[int, str]
    """Added tokens (special or not) by id: their text is literal, not vocabulary spelling."""
    kind: str
    """``"byte_level"``, ``"sentencepiece"`` or ``"other"``, from the decoder pipeline."""
    space: str
    """The SentencePiece space marker (``▁``)."""
    byte_fallback: bool
    """Whether ``<0xNN>`` tokens stand for bytes."""


_INFO: weakref.WeakKeyDictionary[Any, _VocabInfo] = weakref.WeakKeyDictionary()


def _info(hf: PreTrainedTokenizerFast) -> _VocabInfo:
    """The cached :class:`_VocabInfo` of ``hf``."""
    info = _INFO.get(hf)
    if info is None:
        backend = hf.backend_tokenizer
        added_tokens = backend.get_added_tokens_decoder()
        decoder = backend.decoder
        steps = _decoder_steps(json.loads(decoder.__getstate__())) if decoder is not None else []
        types = {step.get("type") for step in steps}
        space = "▁"
        for step in steps:
            if step.get("type") == "Metaspace":
                space = step.get("replacement", space)
            elif step.get("type") == "Replace" and step.get("content") == " ":
                space = step.get("pattern", {}).get("String", space)
        if "ByteLevel" in types:
            kind = "byte_level"
        elif types & {"Metaspace", "ByteFallback"} or any(step.get("type") == "Replace" for step in steps):
            kind = "sentencepiece"
        else:
            kind = "other"
        info = _VocabInfo(
            special_ids=frozenset(i for i, t in added_tokens.items() if t.special),
            added={i: t.content for i, t in added_tokens.items()},
            kind=kind,
            space=space,
            byte_fallback="ByteFallback" in types,
        )
        _INFO[hf] = info
    return info


def _decoder_steps(decoder: dict[str, Any]) -> list[dict[str, Any]]:
    """The decoders of a (possibly nested) ``Sequence`` decoder, in order."""
    if decoder.get("type") == "Sequence":
        return [step for child in decoder.get("decoders", []) for step in _decoder_steps(child)]
    return [decoder]


def _hf(tokenizer: Tokenizer | PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The transformers fast tokenizer behind our :class:`~myserve.tokenizer.Tokenizer`, or itself."""
    hf = getattr(tokenizer, "hf", None)
    return cast("PreTrainedTokenizerFast", tokenizer if hf is None else hf)
