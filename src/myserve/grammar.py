"""Grammar-constrained decoding, host side: a request's constraint compiled once, and one matcher per
constrained sequence that yields the next token's bitmask.

Shared by the process roles (top level for that): the front end validates a request's constraint
before sending it, the engine core compiles it and advances each sequence's matcher.

The library is llguidance (chosen over xgrammar by measurement on SmolLM2's 49k vocabulary, see
docs/design/core.md, "Grammars"): no runtime dependency (xgrammar requires torch),
a [32, 1536] bitmask filled in ~0.1 ms (xgrammar: 5-6 ms, 3 ms per row inside a length-bounded
string), grammars built in about a millisecond, and an explicit error for every JSON-schema keyword
it cannot enforce.

A ``GrammarSpec`` is what a request asked for (a JSON schema, any JSON object, a regex, a list of
choices, or a Lark/GBNF grammar); ``Grammars`` (one per engine, holding the tokenizer as
llguidance sees it) validates a spec once and keeps a template matcher per spec, so a repeated
schema costs a copy; each constrained sequence gets its own ``GrammarMatcher``, advanced by its
accepted tokens. The bitmask format is llguidance's: int32 ``[rows, ceil(vocab / 32)]``, bit
``t % 32`` of word ``t // 32`` set when token ``t`` is allowed; the sampler applies it on the
device (``runtime/sampler.py::apply_token_bitmask``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import llguidance
import llguidance.numpy
import numpy as np

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the type stubs only
    from transformers import PreTrainedTokenizerFast

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is emitted with fixed separators and no other whitespace: a model cannot loop on blanks."""

_CACHE_SIZE = 256
"""Template matchers kept (least recently used first out)."""


class InvalidGrammar(ValueError):
    """A constraint that cannot be compiled or enforced; the message says why (an HTTP 400)."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. Hashable: the cache key of its compiled grammar."""

    kind: GrammarKind
    source: str
    """The JSON schema (JSON text; ignored for ``json_object``), the regex, the choices (a JSON list
    of strings), or the grammar in Lark or GBNF syntax."""
    lenient: bool = False
    """``json_schema`` only: keywords llguidance cannot enforce are ignored instead of refused
    (OpenAI's ``strict: false``)."""

    def to_llguidance(self) -> str:
        """The llguidance grammar definition (not yet validated)."""
        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=_JSON_OPTIONS)
            if self.kind == "json_schema":
                options: JsonCompileOptions = {**_JSON_OPTIONS, "lenient": self.lenient}
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, overrides=options)
            if self.kind == "choice":
                choices = json.loads(self.source)
                if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                    raise InvalidGrammar("choice must be a non-empty list of strings")
            return llguidance.grammar_from(self.kind, self.source)
        except ValueError as e:  # InvalidGrammar is one; llguidance raises ValueError for bad JSON
            raise InvalidGrammar(f"invalid {self.kind}: {e}") from None


class GrammarMatcher:
    """One constrained sequence's grammar state, advanced by the tokens it accepted."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        _alive.add(self)
        self._matcher = matcher
        self.vocab_size = vocab_size
        """The model's vocabulary: the width of this matcher's bitmask rows (in bits)."""

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar did not allow it (the matcher is then
        in an error state for good: the engine never samples a masked token, so this is a bug)."""
        return bool(self._matcher.consume_token(token))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a preempted sequence that recomputes)."""
        if not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (the choices of an n > 1 request)."""
        return GrammarMatcher(self._matcher.deep_copy(), self.vocab_size)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end of the sequence."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (ending here is allowed)."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str:
        """Why the matcher failed, or an empty string."""
        return str(self._matcher.get_error())


_alive: weakref.WeakSet[GrammarMatcher] = weakref.WeakSet()


def matchers_alive() -> int:
    """``GrammarMatcher``s alive in this process: in the engine, one per constrained sequence that has
    not finished (a finished one drops its matcher); more at idle means one was kept (the soak checks)."""
    return len(_alive)


class Grammars:
    """One engine's grammar compiler: the tokenizer as llguidance sees it, and validated grammars."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos_ids: Iterable[int]):
        """``vocab_size``: the model's (its logits' width, which may exceed the tokenizer's)."""
        import llguidance.hf  # imports transformers: only where a tokenizer is at hand

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
        self._templates: collections.OrderedDict[GrammarSpec, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()

    def validate(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` (cached); InvalidGrammar naming the problem if it cannot be enforced."""
        self._template(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for one sequence constrained by ``spec``."""
        return GrammarMatcher(self._template(spec).deep_copy(), self.vocab_size)

    def _template(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        with self._lock:
            template = self._templates.get(spec)
            if template is not None:
                self._templates.move_to_end(spec)
                return template
        grammar = spec.to_llguidance()
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidGrammar(f"invalid {spec.kind}: {error}")
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidGrammar(f"invalid {spec.kind}: {template.get_error()}")
        with self._lock:
            self._templates[spec] = template
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
        return template


class LazyGrammars:
    """A ``Grammars`` built on first use (its tokenizer table takes ~0.25 s): only processes that
    see a constrained request pay for it. Thread-safe; call it to get the compiler."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos_ids: Iterable[int]):
        self._args = (tokenizer, vocab_size, tuple(eos_ids))
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()

    def __call__(self) -> Grammars:
        with self._lock:
            if self._grammars is None:
                self._grammars = Grammars(*self._args)
            return self._grammars


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """int32 [rows, ceil(vocab_size / 32)], every token allowed (all bits set)."""
    return np.full((rows, -(-vocab_size // 32)), -1, np.int32)


_executor: llguidance.LLExecutor | None = None


def fill_bitmask(rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
    """Write each matcher's allowed next tokens into its row of ``bitmask`` (in parallel, without
    the GIL); rows not named keep what they hold."""
    global _executor
    if not rows:
        return
    if _executor is None:
        _executor = llguidance.LLExecutor()
    pairs = [(m._matcher, row) for m, row in rows]
    llguidance.numpy.fill_next_token_bitmask_par(_executor, pairs, bitmask)
