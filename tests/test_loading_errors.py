"""Bad checkpoints fail with one clear line naming the file, from the API and from the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from myserve.errors import CheckpointError
from myserve.models.checkpoint import resolve_checkpoint
from myserve.models.loading import open_source


def load_error(checkpoint: str | Path) -> str:
    with pytest.raises(CheckpointError) as info:
        open_source(resolve_checkpoint(checkpoint))
    message = str(info.value)
    assert "\n" not in message
    return message


def write_gguf(path: Path, arch: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_copy(tiny_checkpoints, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoints["llama3"], tmp_path / "ckpt"))


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert load_error(tmp_path) == f"{tmp_path}: not an HF checkpoint directory (no config.json)"


def test_unsupported_architecture(tiny_copy: Path) -> None:
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    msg = load_error(tiny_copy)
    assert msg.startswith(str(tiny_copy / "config.json")) and "unsupported architecture 'GPT2LMHeadModel'" in msg


def test_corrupt_safetensors(tiny_copy: Path) -> None:
    (tiny_copy / "model.safetensors").write_bytes(b"\x07\x00\x00\x00\x00\x00\x00\x00garbage!" * 3)
    msg = load_error(tiny_copy)
    assert msg.startswith(str(tiny_copy / "model.safetensors")) and "corrupt" in msg


def test_truncated_safetensors(tiny_copy: Path) -> None:
    f = tiny_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    msg = load_error(tiny_copy)
    assert str(f) in msg


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    msg = load_error(path)
    assert msg.startswith(str(path)) and "unsupported GGUF architecture 'gpt2'" in msg


def test_gguf_garbage_and_missing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    assert load_error(bad).startswith(f"{bad}: not a readable GGUF file")
    assert load_error(tmp_path / "missing.gguf") == f"{tmp_path / 'missing.gguf'}: GGUF file not found"


def test_hub_id_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    msg = load_error("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert msg.startswith("HuggingFaceTB/SmolLM2-135M-Instruct: not found locally and not in the HF cache")


def test_hub_id_resolved_from_cache(tiny_checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id whose snapshot sits in the local HF cache loads offline."""
    import huggingface_hub.constants as hc

    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_checkpoints["qwen3"], snapshot)
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = open_source(resolve_checkpoint("acme/tiny"))
    assert source.spec.model_type == "qwen3"


def test_sliding_window_is_served_past_the_window(tiny_copy: Path) -> None:
    """A Mistral window no longer caps the context: every layer slides over its last 128 positions."""
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg.update(model_type="mistral", sliding_window=128)
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    spec = open_source(resolve_checkpoint(tiny_copy)).spec
    assert spec.sliding_window == 128 and spec.layer_types == ("sliding",) * spec.num_layers
    assert {k.window for k in spec.layer_kinds()} == {128}


def test_vision_towers_other_than_the_familys_are_refused(tiny_copy: Path) -> None:
    """Gemma 3 takes a SigLIP tower, LLaVA a CLIP one: another is a one-line error naming it."""
    from myserve.models.checkpoint import vision_spec_of

    text = json.loads((tiny_copy / "config.json").read_text())
    for family, tower in (("gemma3", "clip_vision_model"), ("llava", "siglip_vision_model")):
        cfg = {"model_type": family, "text_config": text, "vision_config": {"model_type": tower}}
        (tiny_copy / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError) as info:
            vision_spec_of(tiny_copy)
        assert str(info.value).startswith(str(tiny_copy / "config.json")) and repr(tower) in str(info.value)


@pytest.mark.parametrize("case", ["no_config", "gguf_arch"])
def test_cli_prints_one_line_without_traceback(case: str, tmp_path: Path) -> None:
    target = tmp_path if case == "no_config" else write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "myserve.generate", "--hf-checkpoint", str(target)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(target) in errors[0]
    assert "Traceback" not in proc.stderr


def test_kv_pool_smaller_than_one_sequence_is_a_config_error(tiny_checkpoints) -> None:
    from myserve.config import load_config
    from myserve.errors import ConfigError
    from myserve.runtime.deployment import Deployment

    config = load_config(
        None, [f"model.checkpoint={tiny_checkpoints['llama3']}", "model.max_model_len=512", "engine.num_pages=8"]
    )
    with pytest.raises(ConfigError) as info:
        Deployment.load(config)  # 8 pages x 16 tokens: a 512-token sequence could never run
    message = str(info.value)
    assert "\n" not in message and "128 tokens" in message and "engine.num_pages to 32" in message
