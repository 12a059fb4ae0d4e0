"""``python -m myserve.bench.device``: the whole command on CPU (tiny), and its parts."""

from __future__ import annotations

import collections
import gzip
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from myserve.bench import steady
from myserve.bench.device import card_slug, check_tokenizer, format_table, roofline
from myserve.bench.device_plan import FULL, RUN_NAMES, TINY, config_variants
from myserve.bench.device_profile import summarize_trace
from myserve.bench.steady import NotSteadyError, Section, wait_steady

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


@pytest.mark.slow
def test_device_command_runs_tiny_on_cpu(tmp_path: Path) -> None:
    """On CPU the command runs tiny by itself and writes the JSON other tools read: every named
    run measured, its roofline share its tokens/s over its roofline, the H100 deployment skipped
    with a reason."""
    output = tmp_path / "device.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "myserve.bench.device",
            "--workdir",
            str(tmp_path / "work"),
            "--output",
            str(output),
            "--set",
            "engine.seed=0",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(output.read_text())
    assert set(doc) == {"device", "jax", "ceilings", "overrides", "tokenizer", "runs"}
    assert doc["overrides"] == ["engine.seed=0"] and doc["tokenizer"] is None
    assert doc["device"] == "cpu" and doc["jax"]
    assert set(doc["ceilings"]) == {"copy_bytes_per_s", "matmul_flops_per_s"}
    assert all(v > 0 for v in doc["ceilings"].values())
    runs = {r["name"]: r for r in doc["runs"]}
    assert [r["name"] for r in doc["runs"]][: len(RUN_NAMES)] == list(RUN_NAMES)
    for name in RUN_NAMES:
        r = runs[name]
        assert {"concurrency", "prompt_tokens", "quantization", "tokens_per_s", "roofline_tokens_per_s"} <= set(r)
        assert r["concurrency"] == (1 if name.endswith("-c1") else TINY.concurrency)
        assert r["tokens_per_s"] > 0 and r["roofline_tokens_per_s"] > 0 and r["prompt_tokens"] > 0
        assert math.isclose(r["roofline_share"], r["tokens_per_s"] / r["roofline_tokens_per_s"], rel_tol=1e-9)
        # Timed in the steady state: what ran, and the tokens per call (a loop when K > 1).
        assert "error" not in r and r["steady_s"] >= 0 and r["decode_steps"] >= 1
        assert r["executables"] and r["step_calls"] > 0
        assert (r["tokens_per_call"] is not None) == (r["concurrency"] > 1 or r["loop_calls"] > 0)
        assert r["decode_steps"] == 1 or r["loop_calls"] > 0, r["executables"]
    assert runs["int4-c1"]["quantization"] == "int4" and runs["bf16-c64"]["quantization"] == "none"
    assert runs["bf16-4k-c64"]["prompt_tokens"] == runs["bf16-4k-c1"]["prompt_tokens"] == TINY.long_prompt
    # Many streams: the prefill and the decode apart (issue 46's figures).
    long = runs["bf16-4k-c64"]
    assert long["prefill_tokens_per_s"] > 0 and long["decode_tokens_per_s"] > 0
    assert 0 < long["prefill_s"] < long["seconds"]
    # int8 reads about a quarter of the float32 weights' bytes; the MoE only its routed experts' share
    assert runs["int8-c1"]["weight_read_bytes"] < 0.4 * runs["bf16-c1"]["weight_read_bytes"]
    assert "skipped" in runs["llama-3.1-8b-h100"] and runs["llama-3.1-8b-h100"]["tokens_per_s"] is None
    assert "bf16-4k-c64" in proc.stdout and "roofline" in proc.stdout


def _tokenizer_dir(directory: Path, chat_template: bool = True) -> Path:
    """A small HF tokenizer folder made on the spot (byte-level BPE: EOS, two role tokens, one id
    per byte) with a chat template: what a device session carries instead of the bundled GGUF."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<eos>": 0, "<|user|>": 1, "<|assistant|>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", additional_special_tokens=["<|user|>", "<|assistant|>"]
    )
    if chat_template:
        hf.chat_template = (
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
    hf.save_pretrained(str(directory))
    return directory


@pytest.mark.slow
def test_device_command_with_own_tokenizer_times_the_decode_loop(tmp_path: Path) -> None:
    """``--tokenizer DIR`` stands in for the bundled model's tokenizer (what the device tool can
    carry); the runs are timed once every executable is built and primed: with K tokens per call
    one stream's decode stretch is loop calls of K tokens each (max_tokens = 1 + 4K: the first
    token comes from the prefill), nothing compiles while timed, and each run says what ran."""
    k = 4
    tokenizer = _tokenizer_dir(tmp_path / "tokenizer")
    output = tmp_path / "device.json"
    flags = f"--tiny --only bf16-c1,bf16-c64 --max-tokens {1 + 4 * k} --set engine.decode_steps={k}".split()
    where = ["--tokenizer", str(tokenizer), "--workdir", str(tmp_path / "work"), "--output", str(output)]
    proc = subprocess.run(
        [sys.executable, "-m", "myserve.bench.device", *flags, *where],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(output.read_text())
    assert doc["tokenizer"] == str(tokenizer.resolve())
    (checkpoint,) = (tmp_path / "work" / "checkpoints").iterdir()
    assert (checkpoint / "tokenizer.json").read_text() == (tokenizer / "tokenizer.json").read_text()
    runs = {r["name"]: r for r in doc["runs"]}
    assert set(runs) == {"bf16-c1", "bf16-c64"}
    for r in runs.values():
        assert "error" not in r and r["tokens_per_s"] > 0 and r["max_tokens"] == 1 + 4 * k
        assert r["decode_steps"] == k and r["steady_s"] >= 0
        assert {"executables", "step_calls", "loop_calls", "tokens_per_call"} <= set(r)
        loops = {n: c for n, c in r["executables"].items() if n.startswith("loop ")}
        assert loops and all(f"x {k} tokens" in n for n in loops), r["executables"]
        assert sum(loops.values()) == r["loop_calls"] > 0
        forwards = sum(c for n, c in r["executables"].items() if n.startswith("forward "))
        assert r["step_calls"] == r["loop_calls"] + forwards
    one = runs["bf16-c1"]
    assert one["loop_calls"] == 4 and one["tokens_per_call"] == k
    many = runs["bf16-c64"]
    assert many["tokens_per_call"] == pytest.approx(many["generated_tokens"] / many["step_calls"])
    assert "tok/call" in proc.stdout


def test_check_tokenizer(tmp_path: Path) -> None:
    """A tokenizer folder stands in for the bundled one when it loads and has a chat template."""
    assert check_tokenizer(_tokenizer_dir(tmp_path / "ok")) is None
    reason = check_tokenizer(_tokenizer_dir(tmp_path / "plain", chat_template=False))
    assert reason and "chat template" in reason
    (tmp_path / "empty").mkdir()
    reason = check_tokenizer(tmp_path / "empty")
    assert reason and "tokenizer.json" in reason


class _Device:
    """What ``steady`` reads of an executor: background builds, built keys, runs and calls."""

    def __init__(self, built: list[tuple], later: list[tuple], done: bool) -> None:
        self.built, self.later, self.done = built, later, done
        self.ran: set[tuple] = set()
        self.calls: collections.Counter = collections.Counter()

    def background_builds_done(self, timeout: float | None = None) -> bool:
        return self.done

    def executables(self) -> dict[tuple, object]:
        return {key: object() for key in self.built}

    def keys(self, op: object) -> list[tuple]:
        return list(self.later)


class _Runner:
    def __init__(self, device: _Device, k: int) -> None:
        self.device, self.decode_steps = device, k

    @property
    def primed(self) -> bool:
        return all(key in self.device.ran for key in self.device.built)

    def compile_ops(self) -> tuple[object, object]:
        return object(), object()


def _service(device: _Device, k: int = 4) -> SimpleNamespace:
    return SimpleNamespace(replicas=[SimpleNamespace(runner=_Runner(device, k))])


SHAPE = collections.namedtuple("Shape", "tokens width singles")(32, 8, 16)  # a StepShape's fields read
FORWARD, HEAD, LOOP = ("forward", SHAPE), ("head", 16, "argmax"), ("loop", SHAPE, 4, "argmax")


def test_wait_steady_fails_naming_what_is_not_built_or_primed() -> None:
    """Not measured half-warm: a limit passed with builds under way or executables never run is
    an error naming them; a steady engine passes at once."""
    building = _Device([FORWARD, HEAD], [FORWARD, LOOP], done=False)
    with pytest.raises(NotSteadyError, match=r"1 still building .*loop argmax 16 rows x 4 tokens, 8 pages"):
        wait_steady(_service(building), timeout_s=0.1)
    unprimed = _Device([FORWARD, HEAD, LOOP], [LOOP], done=True)
    unprimed.ran = {FORWARD, HEAD}
    with pytest.raises(NotSteadyError, match=r"1 built but never run \(loop argmax"):
        wait_steady(_service(unprimed), timeout_s=0.1)
    unprimed.ran.add(LOOP)
    assert wait_steady(_service(unprimed), timeout_s=0.1) < 0.1
    assert steady.name(FORWARD) == "forward 32 tokens x 8 pages, 16 rows"
    assert steady.name(HEAD) == "head argmax 16 rows" and steady.name(("score", 32)) == "score 32 tokens"


def test_section_counts_the_calls_and_flags_what_contradicts_the_steady_state(monkeypatch) -> None:
    """A section's figures are the differences of the executors' calls; one stream's tokens per
    call are its decode tokens per loop call; a build while timed, or K > 1 and no loop, is a
    problem."""
    device = _Device([FORWARD, HEAD, LOOP], [], done=True)
    service = _service(device)
    device.calls.update({FORWARD: 5})  # before the section: not counted
    section = Section(service)
    device.calls.update({FORWARD: 2, HEAD: 2, LOOP: 4})
    figures, problems = section.finish(16, one_stream=True)
    assert problems == []
    assert figures == {
        "decode_steps": 4,
        "executables": {"forward 32 tokens x 8 pages, 16 rows": 2, "head argmax 16 rows": 2,
                        "loop argmax 16 rows x 4 tokens, 8 pages": 4},
        "step_calls": 6,
        "loop_calls": 4,
        "tokens_per_call": 4.0,
    }  # fmt: skip
    section = Section(service)
    device.calls.update({FORWARD: 3, HEAD: 3})
    monkeypatch.setattr(steady.compile_counter, "compile_count", lambda: 10**9)
    figures, problems = section.finish(24, one_stream=False)
    assert figures["tokens_per_call"] == 8.0 and figures["loop_calls"] == 0
    assert len(problems) == 2 and "built during the timed section" in problems[0]
    assert "K = 4" in problems[1] and "no decode loop ran" in problems[1]
    _, problems = Section(_service(device, k=1)).finish(3, one_stream=True)
    assert problems == []  # K = 1: nothing says a loop must have run


def test_table_shows_tokens_per_call() -> None:
    doc = {"device": "cpu", "jax": "0", "ceilings": {"copy_bytes_per_s": 1e9, "matmul_flops_per_s": 1e12}}
    doc["runs"] = [{"name": "bf16-c1", "concurrency": 1, "prompt_tokens": 9, "quantization": "none",
                    "tokens_per_s": 10.0, "roofline_tokens_per_s": 20.0, "roofline_share": 0.5,
                    "tokens_per_call": 4.0}]  # fmt: skip
    row = format_table(doc).splitlines()[-1]
    assert "50.0%" in row and "4.00" in row


def test_roofline_is_concurrency_times_bandwidth_over_bytes_read() -> None:
    entry = {"concurrency": 4, "prompt_tokens": 100, "tokens_per_s": 50.0}
    entry |= {"weight_read_bytes": 1000, "kv_bytes_per_token": 2}
    roofline(entry, copy_bytes_per_s=1e6, max_tokens=20)
    assert entry["kv_read_bytes"] == 4 * (100 + 10) * 2
    assert entry["roofline_tokens_per_s"] == pytest.approx(4 * 1e6 / (1000 + 880))
    assert entry["roofline_share"] == pytest.approx(50.0 / entry["roofline_tokens_per_s"])
    failed = {"concurrency": 1, "prompt_tokens": 0, "tokens_per_s": None}
    roofline(failed, 1e6, 20)
    assert failed["roofline_tokens_per_s"] is None and failed["roofline_share"] is None


def test_card_slug() -> None:
    assert card_slug("NVIDIA H200") == "nvidia-h200"
    assert card_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert card_slug("cpu") == "cpu" and card_slug("TPU v5 lite") == "tpu-v5-lite"


def test_h100_deployments_run_only_where_they_fit() -> None:
    """The shipped H100 config runs on random weights of Llama-3.1-8B's shape when weights plus KV
    pool fit the device; tiny mode and a small device skip it, saying why."""
    (fits,) = config_variants(FULL, CONFIG_DIR, memory_bytes=80 * 10**9)
    assert fits.name == "llama-3.1-8b-h100" and fits.shape == "llama-3.1-8b" and fits.skip is None
    assert fits.config and fits.config.endswith("llama-3.1-8b-h100.yaml")
    (small,) = config_variants(FULL, CONFIG_DIR, memory_bytes=24 << 30)
    assert small.skip and "GiB" in small.skip
    (tiny,) = config_variants(TINY, CONFIG_DIR, memory_bytes=80 * 10**9)
    assert tiny.skip and "tiny" in tiny.skip


def test_trace_summary(tmp_path: Path) -> None:
    """Busy time is the union of the device's intervals over the wall time; each step module's calls
    are counted, a step is a forward or a decode-loop call, and kernels and host time per step
    count every step module's."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]

    def kernel(module: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
        return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": {"hlo_module": module}}

    def call(module: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "pid": 7, "tid": 9, "name": f"CommonPjRtLoadedExecutable::Execute ({module})", "ts": ts,
                "dur": dur}  # fmt: skip

    events = [
        *meta,
        kernel("jit_forward_step", "fusion_1", 0.0, 100.0),
        kernel("jit_head_step", "fusion_2", 50.0, 100.0, tid=2),  # overlaps: 150 us busy
        kernel("jit_decode_loop", "fusion_3", 1000.0, 50.0),
        {"ph": "X", "pid": 1, "tid": 3, "name": "MemcpyD2H", "ts": 1100.0, "dur": 10.0, "args": {}},
        call("jit_forward_step", 0.0, 1500.0),
        call("jit_head_step", 0.0, 500.0),
        call("jit_decode_loop", 900.0, 1000.0),
        call("jit_model_step", 900.0, 1000.0),  # not a step module (any more): not counted
    ]
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    s = summarize_trace(path, wall_s=0.01)
    assert s["available"] and s["steps"] == 2
    modules = s["modules"]
    assert {m: v["calls"] for m, v in modules.items()} == {
        "jit_forward_step": 1, "jit_head_step": 1, "jit_decode_loop": 1, "jit_score_step": 0
    }  # fmt: skip
    assert modules["jit_decode_loop"]["kernels"] == 1 and modules["jit_forward_step"]["host_ms_in_execute"] == 1.5
    assert s["device_busy_s"] == pytest.approx(210e-6) and s["device_busy_share"] == pytest.approx(0.021)
    assert s["kernels_per_step"] == 1.5 and s["host_ms_in_execute_per_step"] == pytest.approx(1.5)
    assert s["host_ms_in_thunks_per_step"] is None
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": meta[1:]}).encode()))
    assert summarize_trace(path, wall_s=0.01)["available"] is False


def test_decode_read_bytes_counts_routed_experts_at_top_k(tmp_path: Path) -> None:
    """A MoE decode step reads k of E experts' weights; a dense one every weight."""
    from myserve.bench.device_worker import _nbytes, decode_read_bytes
    from myserve.bench.random_checkpoint import SHAPES, make_random_llama
    from myserve.config import load_config
    from myserve.runtime.deployment import Deployment

    directory = make_random_llama("tiny-moe", tmp_path / "moe")
    model = Deployment.load(load_config(None, [f"model.checkpoint={directory}"])).model
    total = _nbytes(model)
    routed = sum(_nbytes(layer.moe.gate_up) + _nbytes(layer.moe.down) for layer in model.layers)
    cfg = SHAPES["tiny-moe"]
    inactive = 1 - cfg["num_experts_per_tok"] / cfg["num_experts"]
    assert decode_read_bytes(model) == pytest.approx(total - inactive * routed, abs=len(model.layers))
    assert 0 < routed < total and decode_read_bytes(model) < total
