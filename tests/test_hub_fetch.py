"""Hub-id checkpoints resolved by the launcher (``myserve/entrypoints/hub.py``), host only: what counts as a hub
id, a cached snapshot used without the network (with ``--download-dir`` and ``--revision``), the
name a hub-id model keeps, and one-line errors offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from myserve.config import load_config
from myserve.entrypoints.hub import fetch, fetch_checkpoints, is_hub_id
from myserve.errors import CheckpointError

SHA = "0123456789abcdef0123456789abcdef01234567"


def cached(cache: Path, repo_id: str, ref: str = "main") -> Path:
    """A snapshot of ``repo_id`` laid out as huggingface_hub caches one."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text(SHA)
    return snapshot


def test_what_is_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()
    assert is_hub_id("org/name") and is_hub_id("gpt2") and is_hub_id("Qwen/Qwen2.5-1.5B-Instruct")
    assert not is_hub_id("local")  # a directory here
    assert not is_hub_id("/models/x") and not is_hub_id("./x") and not is_hub_id("~/x")
    assert not is_hub_id("x.gguf") and not is_hub_id(None) and not is_hub_id("a/b/c")


def test_a_cached_snapshot_is_used_without_the_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any network use would fail
    snapshot = cached(tmp_path, "org/tiny")
    assert fetch("org/tiny", cache_dir=str(tmp_path)) == snapshot
    config = load_config(None, ["model.checkpoint=org/tiny", f"model.download_dir={tmp_path}"])
    fetched = fetch_checkpoints(config)
    assert fetched.model.checkpoint == str(snapshot)
    assert fetched.server.served_model_name == "SmolLM2-135M-Instruct"  # the bundled YAML names it
    unnamed = load_config(
        None, ["model.checkpoint=org/tiny", f"model.download_dir={tmp_path}", "server.served_model_name=null"]
    )
    assert fetch_checkpoints(unnamed).server.served_model_name == "tiny"  # the repository's name, as before
    branch = cached(tmp_path / "b", "org/other", ref="v1")
    assert fetch("org/other", revision="v1", cache_dir=str(tmp_path / "b")) == branch
    plain = load_config(None, ["model.checkpoint=/models/x"])
    assert fetch_checkpoints(plain) == plain  # a path is left alone


def test_offline_and_not_cached_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="org/missing: not in the cache and cannot be downloaded") as e:
        fetch("org/missing", cache_dir=str(tmp_path))
    assert "\n" not in str(e.value)
