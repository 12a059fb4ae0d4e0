"""``python -m myserve.bench.quality`` over real HTTP: two tiny random models (SmolLM2's vocabulary,
so that text tokenizes into it) behind the real app, a 64-token context so that the text is
scored in two windows. The perplexity equals transformers' on the same windows; a variant against
itself agrees fully, another model does not."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_server import LiveServer

from myserve.bench.quality import PARITY_PROMPTS, Variant, agreement, main, parse_args, windows
from myserve.bundled import bundled_gguf_path
from myserve.frontend.app import create_app
from myserve.testing import TINY_ENGINE, hf_logits, make_tiny_checkpoint, start_service
from myserve.tokenizer import Tokenizer

MAX_MODEL_LEN = 64  # windows of 63 tokens
TEXT_CHARS = 400  # about 90 tokens of the shipped text: two windows
GREEDY_TOKENS = 8  # the chat-templated parity prompts are at most 40 tokens: 48 fit


def test_windows_count_every_token_but_the_first_once() -> None:
    assert windows(10, 4, 3) == [(0, 4, 1), (3, 7, 4), (6, 10, 7)]
    assert windows(10, 4, 1) == [(0, 4, 1), (1, 5, 4), (2, 6, 5), (3, 7, 6), (4, 8, 7), (5, 9, 8), (6, 10, 9)]
    assert windows(3, 63, 62) == [(0, 3, 1)]
    for n, window, stride in [(100, 63, 62), (101, 10, 4), (7, 2, 1)]:
        scored = [t for start, end, first in windows(n, window, stride) for t in range(first, end)]
        assert scored == list(range(1, n))
        assert all(start < first and end - start <= window for start, end, first in windows(n, window, stride))
    with pytest.raises(ValueError):
        windows(10, 4, 4)  # a window's first scored token would have no context in it


def test_agreement_identical_fraction_and_common_prefix() -> None:
    ref = [["a", "b", "c", "d"], ["x", "y", "z", "w"]]
    assert agreement(ref, ref, 4) == (1.0, 1.0)
    assert agreement(ref, [["a", "b", "q", "d"], ["x", "y", "z", "w"]], 4) == (0.5, (2 + 4) / 8)


def test_variants_from_the_command_line() -> None:
    args, variants = parse_args(
        ["--variant", "f32=", "--variant", "int8=--set model.quantization=int8", "--variant", "up=http://h:1/"]
        + ["--", "--max-model-len", "512"]
    )
    assert variants == [
        Variant("f32", serve_args=("--max-model-len", "512")),
        Variant("int8", serve_args=("--max-model-len", "512", "--set", "model.quantization=int8")),
        Variant("up", url="http://h:1"),
    ]
    assert args.max_tokens == 32
    assert parse_args(["--url", "http://h:2"])[1] == [Variant("server", url="http://h:2")]
    assert parse_args(["--", "--port", "9"])[1] == [Variant("server", serve_args=("--port", "9"))]
    with pytest.raises(SystemExit):
        parse_args(["--variant", "a=http://h:1", "--variant", "a=http://h:2"])


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """Two tiny Llamas of different random weights, each behind the app: (checkpoint, url) pairs."""
    started = []
    try:
        for seed in (0, 1):
            checkpoint = make_tiny_checkpoint(
                "llama3", tmp_path_factory.mktemp(f"seed{seed}"), seed=seed, vocab_size=49152
            )
            svc = start_service(checkpoint, *TINY_ENGINE, "engine.num_pages=64", f"model.max_model_len={MAX_MODEL_LEN}")
            started.append((checkpoint, svc, LiveServer(create_app(svc, served_model_name="tiny"))))
        yield [(checkpoint, live.url) for checkpoint, _, live in started]
    finally:
        for _, svc, live in started:
            live.stop()
            svc.shutdown()


def transformers_ppl(checkpoint: Path, ids: list[int]) -> float:
    """The perplexity of ``ids`` scored as two windows, tokens [0, 63) and [62, n) (each token but
    the first counted once), computed with transformers."""
    assert MAX_MODEL_LEN - 1 < len(ids) <= 2 * (MAX_MODEL_LEN - 2)
    total, count = 0.0, 0
    for start, end in ((0, MAX_MODEL_LEN - 1), (MAX_MODEL_LEN - 2, len(ids))):
        window = ids[start:end]
        logits = np.asarray(hf_logits(checkpoint, window), dtype=np.float64)
        logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        total += float(sum(logprobs[i - 1, window[i]] for i in range(1, len(window))))
        count += len(window) - 1
    return math.exp(-total / count)


def test_perplexity_and_agreement_over_http(servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (checkpoint, url), (_, other_url) = servers
    shipped = (Path(__file__).parents[1] / "src/myserve/bench/data/perplexity.txt").read_text(encoding="utf-8")
    text = tmp_path / "text.txt"
    text.write_text(shipped[:TEXT_CHARS], encoding="utf-8")
    ids = Tokenizer.load(bundled_gguf_path()).encode(shipped[:TEXT_CHARS], add_special_tokens=False)
    out = tmp_path / "quality.json"
    argv = ["--text", str(text), "--max-tokens", str(GREEDY_TOKENS), "--output", str(out)]
    argv += ["--variant", f"ref={url}", "--variant", f"same={url}", "--variant", f"other={other_url}"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    ref, same, other = report["variants"]

    assert (ref["window"], ref["stride"], ref["windows"]) == (MAX_MODEL_LEN - 1, MAX_MODEL_LEN - 2, 2)
    assert ref["text_tokens"] == len(ids) and ref["tokens_scored"] == len(ids) - 1
    assert ref["ppl"] == pytest.approx(transformers_ppl(checkpoint, ids), rel=1e-4)
    assert ref["ppl"] == pytest.approx(math.exp(-ref["logprob_sum"] / ref["tokens_scored"]))

    assert same["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert (same["greedy_identical"], same["greedy_prefix"]) == (1.0, 1.0)
    assert [len(g["tokens"]) for g in same["greedy"]] == [GREEDY_TOKENS] * len(PARITY_PROMPTS)

    assert other["ppl_ratio"] != pytest.approx(1.0, abs=1e-3)
    assert other["greedy_identical"] < 1.0 and other["greedy_prefix"] < 1.0

    printed = capsys.readouterr().out
    assert "ppl / ref" in printed and all(label in printed for label in ("ref", "same", "other"))
