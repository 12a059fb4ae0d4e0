"""The stand-in Hub (myserve.testing.stand_in_hub) serves a local directory as a Hub model repo that
huggingface_hub's own ``snapshot_download`` downloads, caches, and reports errors for as on the Hub."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from myserve.testing.stand_in_hub import StandInHub

REPO = "org/tiny-llama"
WANTED = ["*.json", "*.safetensors", "extra/**"]
EXPECTED = {"config.json", "model.safetensors", "tokenizer.json", "extra/notes/readme.txt"}


@pytest.fixture(autouse=True)
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """huggingface_hub online, without telemetry, and with no token of the machine's own.

    huggingface_hub reads its environment once, at import: the variables are set for anything this test
    starts, and the constants already read are patched for this process."""
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


@pytest.fixture
def repo_dir(tmp_path: Path) -> Path:
    """A tiny model repo: a config, random weights, a tokenizer, a nested file, and a file left out."""
    root = tmp_path / "repo"
    (root / "extra" / "notes").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (root / "model.safetensors").write_bytes(random.Random(0).randbytes(300))
    (root / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (root / "extra" / "notes" / "readme.txt").write_text("nested\n")
    (root / "pytorch_model.bin").write_bytes(b"not wanted" * 10)
    return root


def files_under(path: str | Path) -> dict[str, bytes]:
    root = Path(path)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_snapshot_download_then_cache(repo_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # page_size=2: the tree listing comes in pages, followed through the Link header
    with StandInHub({REPO: repo_dir}, page_size=2) as hub:
        sha = HfApi(endpoint=hub.url).model_info(REPO, revision="main").sha
        path = snapshot_download(REPO, revision="main", cache_dir=cache, allow_patterns=WANTED, endpoint=hub.url)
        assert sha is not None and re.fullmatch(r"[0-9a-f]{40}", sha)
        assert Path(path) == cache / "models--org--tiny-llama" / "snapshots" / sha
        assert (cache / "models--org--tiny-llama" / "refs" / "main").read_text() == sha
        got = files_under(path)
        assert set(got) == EXPECTED
        assert got == {name: (repo_dir / name).read_bytes() for name in EXPECTED}
        assert hub.requests.count(f"/api/models/{REPO}/tree/{sha}") > 1  # paginated
        assert not any(p.endswith("pytorch_model.bin") for p in hub.requests)
        downloads = [p for m, p in hub.calls if m == "GET" and "/resolve/" in p]
        assert sorted(downloads) == sorted(f"/{REPO}/resolve/{sha}/{name}" for name in EXPECTED)

        # a second call online asks for the commit only: the tree listing and the files are cached
        seen = len(hub.requests)
        again = snapshot_download(REPO, revision="main", cache_dir=cache, allow_patterns=WANTED, endpoint=hub.url)
        assert again == path
        assert hub.requests[seen:] == [f"/api/models/{REPO}/revision/main"]

    # the hub is stopped: the cache answers, with local_files_only and without it (connection refused)
    assert (
        snapshot_download(REPO, revision="main", cache_dir=cache, allow_patterns=WANTED, local_files_only=True) == path
    )
    assert snapshot_download(REPO, revision="main", cache_dir=cache, allow_patterns=WANTED, endpoint=hub.url) == path
    with pytest.raises(httpx.ConnectError):
        httpx.get(hub.url)


def test_commit_follows_the_files(repo_dir: Path) -> None:
    with StandInHub({REPO: repo_dir}) as hub:
        api = HfApi(endpoint=hub.url)
        first = api.model_info(REPO).sha
        assert api.model_info(REPO, revision="main").sha == first
        (repo_dir / "config.json").write_text("{}")
        assert api.model_info(REPO).sha != first
        tree = {f.path for f in api.list_repo_tree(REPO, recursive=True)}
        assert tree == {*EXPECTED, "pytorch_model.bin", "extra", "extra/notes"}
        top = {"config.json", "model.safetensors", "tokenizer.json", "pytorch_model.bin", "extra"}
        assert {f.path for f in api.list_repo_tree(REPO)} == top
        assert {f.path for f in api.list_repo_tree(REPO, "extra/notes")} == {"extra/notes/readme.txt"}


def test_errors_as_the_hub_reports_them(repo_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with StandInHub({REPO: repo_dir}) as hub:
        with pytest.raises(RepositoryNotFoundError):
            snapshot_download("org/missing", cache_dir=cache, endpoint=hub.url)
        with pytest.raises(RevisionNotFoundError):
            snapshot_download(REPO, revision="v9.9", cache_dir=cache, endpoint=hub.url)
        with pytest.raises(RevisionNotFoundError):  # a commit sha goes straight to the tree listing
            snapshot_download(REPO, revision="0" * 40, cache_dir=cache, endpoint=hub.url)
        with pytest.raises(RevisionNotFoundError):  # quoted as refs%2Fpr%2F1
            snapshot_download(REPO, revision="refs/pr/1", cache_dir=cache, endpoint=hub.url)
        with pytest.raises(RemoteEntryNotFoundError):
            hf_hub_download(REPO, "nope.json", cache_dir=cache, endpoint=hub.url)
    assert not (cache / "models--org--tiny-llama" / "snapshots").exists()


def test_token(repo_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with StandInHub({REPO: repo_dir}, token="hf_secret") as hub:
        # as the Hub answers an anonymous request for a private repo: 401, RepoNotFound
        with pytest.raises(RepositoryNotFoundError) as anonymous:
            snapshot_download(REPO, cache_dir=cache, allow_patterns=WANTED, endpoint=hub.url, token=False)
        assert anonymous.value.response.status_code == 401
        with pytest.raises(HfHubHTTPError) as wrong:
            snapshot_download(REPO, cache_dir=cache, allow_patterns=WANTED, endpoint=hub.url, token="hf_other")
        assert wrong.value.response.status_code == 401
        path = snapshot_download(REPO, cache_dir=cache, allow_patterns=WANTED, endpoint=hub.url, token="hf_secret")
    assert set(files_under(path)) == EXPECTED


def test_hf_endpoint_in_a_child_process(repo_dir: Path, tmp_path: Path) -> None:
    """What a served model's process does: HF_ENDPOINT in its environment, no ``endpoint=`` anywhere."""
    code = (
        "import sys; from huggingface_hub import snapshot_download; "
        "print(snapshot_download(sys.argv[1], cache_dir=sys.argv[2], allow_patterns=['*.json']))"
    )
    with StandInHub({REPO: repo_dir}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        done = subprocess.run(
            [sys.executable, "-c", code, REPO, str(tmp_path / "cache")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    assert set(files_under(done.stdout.strip())) == {"config.json", "tokenizer.json"}
    assert any(p.startswith(f"/{REPO}/resolve/") for p in hub.requests)
