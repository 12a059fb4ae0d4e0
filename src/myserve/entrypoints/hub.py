"""Checkpoints named by hub id, downloaded before anything loads them (as ``vllm serve`` does).

The launcher (``serve``, ``run_batch``, ``generate``) calls ``fetch_checkpoints`` once, before any
engine core or front end starts: each hub-id checkpoint (and tokenizer) is looked up in the cache
(``model.download_dir``, else the Hugging Face cache), downloaded with ``huggingface_hub`` when it
is not there (its progress bars on the terminal), and replaced in the config by its local snapshot
directory, so that every process after it reads local files only. The model keeps the name it was
asked for. ``huggingface_hub`` honours ``HF_TOKEN``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` (offline:
the cache only). A snapshot already in the cache is used as it is, without asking the Hub.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from myserve.config import Config, ModelConfig
from myserve.errors import CheckpointError

logger = logging.getLogger("myserve.serve")

WEIGHT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
"""What a model needs of its repository: configs, safetensors weights, tokenizer and template files
(never the .bin/.pth/.gguf copies many repositories also hold)."""

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub_id(value: str | None) -> bool:
    """Whether ``value`` names a hub repository rather than a local path (nothing there, not a
    ``.gguf`` file name, not absolute or relative to a directory)."""
    if not value or value.endswith(".gguf") or value.startswith((".", "/", "~")):
        return False
    return _REPO_ID.match(value) is not None and not Path(value).exists()


def fetch(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision``: from the cache, else downloaded.
    Raises ``CheckpointError`` in one line (unknown repository or revision, refused token,
    offline without a cached copy, the Hub unreachable)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = repo_id if revision is None else f"{repo_id}@{revision}"
    cache = None if cache_dir is None else str(Path(cache_dir).expanduser())
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache, allow_patterns=WEIGHT_FILES, local_files_only=True
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass  # not cached: download it
    except ValueError as e:  # HFValidationError: not a repository id
        raise CheckpointError(f"{repo_id}: no such directory or file, and not a valid hub id ({e})") from None
    logger.info("downloading %s from the Hub into %s", where, cache or "the Hugging Face cache")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=WEIGHT_FILES))
    except RevisionNotFoundError:
        raise CheckpointError(f"{where}: the Hub has no such revision") from None
    except GatedRepoError:
        raise CheckpointError(f"{repo_id}: gated on the Hub; accept its terms and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo_id}: no such directory or file, and no such model on the Hub (or it is private: set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError as e:
        raise CheckpointError(f"{where}: not in the cache and cannot be downloaded ({_first_line(e)})") from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{where}: download failed: {_first_line(e)}") from None


def fetch_checkpoints(config: Config) -> Config:
    """``config`` with every hub-id checkpoint and tokenizer replaced by its local snapshot
    (downloaded when not cached); a model whose name came from its checkpoint keeps that name."""
    server = config.server
    if not config.models:  # with several models, each entry has its name (the top level none)
        server = dataclasses.replace(server, served_model_name=_named(server.served_model_name, config.model))
    entries = tuple(
        dataclasses.replace(e, model=_fetched(e.model), served_model_name=_named(e.served_model_name, e.model))
        for e in config.models
    )
    return dataclasses.replace(config, model=_fetched(config.model), server=server, models=entries)


def _named(names: str | tuple[str, ...] | None, model: ModelConfig) -> str | tuple[str, ...] | None:
    """A model's names, or for one configured by hub id without any, the repository's name (what
    it has always been served under: the local snapshot's directory name is a commit hash)."""
    if names is not None or not is_hub_id(model.checkpoint):
        return names
    assert model.checkpoint is not None
    return model.checkpoint.rsplit("/", 1)[-1]


def _fetched(model: ModelConfig) -> ModelConfig:
    checkpoint, tokenizer = model.checkpoint, model.tokenizer
    if is_hub_id(checkpoint):
        assert checkpoint is not None
        checkpoint = str(fetch(checkpoint, model.revision, model.download_dir))
    if is_hub_id(tokenizer):
        assert tokenizer is not None
        tokenizer = str(fetch(tokenizer, None, model.download_dir))
    if (checkpoint, tokenizer) == (model.checkpoint, model.tokenizer):
        return model
    return dataclasses.replace(model, checkpoint=checkpoint, tokenizer=tokenizer)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
