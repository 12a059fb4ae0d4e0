"""The tokenizer: a transformers fast tokenizer loaded from a directory, a cached hub id or a GGUF file.

Shared by the process roles (top level for that): the front end tokenizes and detokenizes, the engine
core reads its EOS ids, the launcher loads it for the front end.

Torch is installed next to us (as the parity reference) and transformers imports it whenever it can:
``AutoTokenizer`` pulls in ``configuration_utils`` -> ``modeling_rope_utils`` -> torch, and
transformers' GGUF reader (``integrations/gguf/reader.py``) imports torch at its top. The server must
not pay for or depend on torch, so this module avoids both:

- directories load ``tokenizer.json`` with ``PreTrainedTokenizerFast`` (the tokenizers backend) rather
  than through ``AutoTokenizer``. AutoTokenizer needs the model config to pick a model-specific class,
  and those classes rebuild the pipeline from their own defaults instead of ``tokenizer.json`` (a
  byte-level vocabulary declared as ``LlamaTokenizer`` gives wrong ids). ``tokenizer.json`` is what the
  checkpoint's authors shipped and what the Rust ``tokenizers`` runtime serves.
- GGUF files are read by a small metadata parser below, and the vocabulary is handed to transformers'
  torch-free ``convert_gguf_tokenizer`` (the same builder ``AutoTokenizer(gguf_file=...)`` ends in).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from myserve.errors import CheckpointError, ConfigError, MyserveError
from myserve.models.gguf_file import read_gguf

if TYPE_CHECKING:  # transformers is imported when a tokenizer loads (0.6 s): off the start-up path
    from transformers import PreTrainedTokenizerFast


class ChatTemplateError(MyserveError):
    """The tokenizer has no chat template, or the template rejected the messages."""


class Tokenizer:
    """Text <-> token ids, chat rendering and end-of-sequence ids for one model."""

    def __init__(self, hf: PreTrainedTokenizerFast, *, source: str, extra_eos_ids: Iterable[int] = ()):
        self.hf = hf
        """The underlying transformers fast tokenizer (for incremental detokenization)."""
        self.source = source
        """Where the tokenizer came from, for messages."""
        eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        # dict.fromkeys: unique while keeping the tokenizer's own EOS first
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_ids]))
        """Ids that end generation: the tokenizer's EOS plus generation_config's (or the GGUF's)."""

    @classmethod
    def load(cls, source: str | os.PathLike[str], *, chat_template: str | None = None) -> Tokenizer:
        """Load from an HF checkpoint directory, a hub id in the local HF cache, or a ``.gguf`` file.

        ``chat_template`` (a file path or the Jinja text itself) replaces the tokenizer's own template.
        """
        path = Path(source).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise CheckpointError(f"{path}: GGUF file not found")
            tok = _from_gguf(path)
        elif path.is_dir():
            tok = _from_directory(path, str(path))
        elif path.exists():
            raise CheckpointError(f"{path}: not a tokenizer directory or .gguf file")
        else:
            tok = _from_directory(_hub_snapshot(str(source)), str(source))
        if chat_template is not None:
            tok.hf.chat_template = _read_chat_template(chat_template)
        return tok

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, if the tokenizer has one."""
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        """Whether :meth:`render_chat` can work."""
        return bool(self.hf.chat_template)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS where the tokenizer wants them."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return cast(str, self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (byte-level spelling, e.g. ``Ġ`` for a space)."""
        tokens = self.hf.convert_ids_to_tokens(list(ids))
        return [tokens] if isinstance(tokens, str) else list(tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text the chat template makes of ``messages`` (and ``tools``, for templates that
        render them); ``chat_template`` replaces the tokenizer's own for this call,
        ``template_kwargs`` are extra template variables, and ``continue_final_message`` leaves the
        last message open (no end-of-turn after it)."""
        template = chat_template or self.hf.chat_template
        if not template:
            raise ChatTemplateError(f"{self.source}: the tokenizer has no chat template; pass chat_template")
        try:
            text = self.hf.apply_chat_template(
                messages,
                tools=cast(Any, tools),
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except Exception as e:  # jinja errors, templates that raise_exception() on bad roles, bad kwargs
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        return cast(str, text)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat prompt."""
        # The template writes BOS and friends itself; adding them again would double them.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


_TRANSFORMERS_IMPORT = threading.Lock()
"""transformers' lazy top-level module fails an import that two threads make at once (``cannot
import name 'PreTrainedTokenizerFast'``): a server of several models loads their tokenizers together."""


def _fast_tokenizer_class() -> type[PreTrainedTokenizerFast]:
    """transformers' ``PreTrainedTokenizerFast``, imported under ``_TRANSFORMERS_IMPORT``."""
    with _TRANSFORMERS_IMPORT:
        from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast


def _from_directory(directory: Path, source: str) -> Tokenizer:
    """A tokenizer from ``tokenizer.json`` (+ config, chat template) and generation_config's EOS ids."""
    if not (directory / "tokenizer.json").is_file():
        raise CheckpointError(f"{directory}: no tokenizer files (tokenizer.json) in this directory")
    try:
        hf = _fast_tokenizer_class().from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # malformed JSON, unknown tokenizer model type, ...
        raise CheckpointError(f"{directory}: cannot load tokenizer ({type(e).__name__}: {e})") from None
    eos = _generation_eos_ids(directory / "generation_config.json")
    return Tokenizer(hf, source=source, extra_eos_ids=eos)


def _generation_eos_ids(gen_config: Path) -> list[int]:
    """``eos_token_id`` (an int or a list) of a generation_config.json; none if the file is absent."""
    if not gen_config.is_file():
        return []
    try:
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
    except (ValueError, AttributeError) as e:  # bad JSON, or JSON that is not an object
        raise CheckpointError(f"{gen_config}: not a valid generation config ({e})") from None
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(i, int) for i in ids):
        raise CheckpointError(f"{gen_config}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


def _hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot directory of a hub id; this machine never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except HFValidationError:
        raise CheckpointError(f"{repo_id}: no such file or directory, and not a valid hub id") from None
    except (LocalEntryNotFoundError, OSError):
        raise CheckpointError(
            f"{repo_id}: not in the local HF cache, and this machine cannot download; pass a directory"
        ) from None


def _read_chat_template(value: str) -> str:
    """The template text: the contents of the file ``value`` names, or ``value`` itself."""
    path = Path(value).expanduser()
    if "\n" not in value and path.is_file():
        return path.read_text()
    if "{" in value:  # every useful Jinja template has a {{ }} or {% %}
        return value
    raise ConfigError(f"chat_template: {value!r} is neither an existing file nor a Jinja template")


# llama.cpp's end-of-generation keys besides EOS: end of turn, end of message.
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _from_gguf(path: Path) -> Tokenizer:
    """A tokenizer from a GGUF's ``tokenizer.*`` metadata.

    This follows transformers' ``get_gguf_tokenizer`` (whose module imports torch for its tensor
    reader) and then calls its torch-free ``convert_gguf_tokenizer``.
    """
    with _TRANSFORMERS_IMPORT:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

    metadata = read_gguf(path, with_tensors=False).metadata
    if "tokenizer.ggml.tokens" not in metadata:
        raise CheckpointError(f"{path}: GGUF has no tokenizer metadata (tokenizer.ggml.tokens)")
    # GGUF_TOKENIZER_MAPPING renames "tokenizer.<key>" to the builder's and the constructor's names
    meta = {k.removeprefix("tokenizer."): v for k, v in metadata.items() if k.startswith("tokenizer.")}
    tokenizer_dict, init_kwargs = (
        {name: meta[key] for key, name in GGUF_TOKENIZER_MAPPING[group].items() if key in meta}
        for group in ("tokenizer", "tokenizer_config")
    )
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # As transformers: llama.cpp adds BOS to a sentencepiece vocabulary unless the file says not to.
        init_kwargs.setdefault("add_bos_token", True)
    try:
        for name, key in _SPECIAL_TOKEN_KEYS.items():
            init_kwargs[name] = tokenizer_dict["tokens"][metadata[key]] if key in metadata else None
        architecture = metadata.get("general.architecture", "")
        backend, extra_kwargs = convert_gguf_tokenizer(architecture, tokenizer_dict)
        hf = _fast_tokenizer_class()(tokenizer_object=backend, **init_kwargs, **extra_kwargs)
    except (ValueError, KeyError, IndexError) as e:  # a tokenizer transformers cannot build, a bad id
        raise CheckpointError(f"{path}: cannot build a tokenizer from this GGUF ({e})") from None
    eos = [metadata[key] for key in _GGUF_EOS_KEYS if key in metadata]
    return Tokenizer(hf, source=str(path), extra_eos_ids=eos)
