"""What ``python -m myserve.bench.device`` runs: its modes, deployments (variants) and runs.

A *variant* is one deployment served by one child process; its *runs* share the deployment's
warmup and differ in concurrency and prompts. Run names are fixed whatever the mode, so results
of different machines line up: ``bf16-c1`` ... ``moe-c64`` (``RUN_NAMES``), then one run per
shipped ``config/*h100.yaml`` deployment, named after its file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

RUN_NAMES = (
    "bf16-c1",
    "bf16-c64",
    "int8-c1",
    "int8-c64",
    "int4-c1",
    "int4-c64",
    "bf16-4k-c1",
    "bf16-4k-c64",
    "moe-c1",
    "moe-c64",
)

CONFIG_SHAPES = {"meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b"}
"""The random-checkpoint shape (``random_checkpoint.SHAPES``) of each shipped config's checkpoint."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class Mode:
    """How large a device run is: its models, dtype, prompts, tokens and engine settings."""

    name: str
    dense: str
    """The dense model's shape (``random_checkpoint.SHAPES``)."""
    moe: str
    dtype: str
    concurrency: int
    long_prompt: int
    """Prompt tokens of the long-context runs (``bf16-4k-c1``, ``bf16-4k-c64``)."""
    max_tokens: int
    timeout_s: float
    """Time limit of one variant's child process."""
    short: tuple[str, ...]
    """Engine overrides of the chat-prompt runs."""
    long: tuple[str, ...]
    """Engine overrides of the long-prompt run."""


# The settings of the H200 measurements of 2026-11-26: two step buckets for decode (1 and 64 rows)
# and one 4,096-token bucket for prefill.
FULL = Mode(
    name="full",
    dense="llama-3.2-1b",
    moe="moe-1b",
    dtype="bfloat16",
    concurrency=64,
    long_prompt=4096,
    max_tokens=128,
    timeout_s=420.0,
    short=(
        "model.max_model_len=512",
        "engine.max_num_seqs=64",
        "engine.token_buckets=[1,64]",
        "engine.max_num_batched_tokens=4096",
    ),
    long=(
        "model.max_model_len=8192",
        "engine.max_num_seqs=64",
        "engine.num_pages=40960",
        "engine.token_buckets=[1,64,4096]",
        "engine.max_num_batched_tokens=4096",
    ),
)
# On a CPU: the yardstick-sized models, 16 streams of 16 tokens for the "c64" runs, 128-token
# "long" prompts, float32 (the run names stay those of the full runs, so tables line up). One
# 32-token step bucket (one row decodes in it too): compiling is most of a tiny run's time. The
# long run uses the same engine settings as the short ones, so it loads their executables from
# the step cache instead of compiling its own.
_TINY_ENGINE = (
    "model.max_model_len=512",
    "engine.max_num_seqs=16",
    "engine.num_pages=2048",
    "engine.token_buckets=[32]",
    "engine.max_num_batched_tokens=32",
)
TINY = Mode(
    name="tiny",
    dense="tiny-llama",
    moe="tiny-moe",
    dtype="float32",
    concurrency=16,
    long_prompt=128,
    max_tokens=16,
    timeout_s=150.0,
    short=_TINY_ENGINE,
    long=_TINY_ENGINE,
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One measurement: ``concurrency`` requests at once (1: one stream's decode rate)."""

    name: str
    concurrency: int
    prompt_tokens: int
    """Random prompts of this many tokens; 0: chat prompts (their length is measured)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One deployment in one child process, and the runs it serves."""

    name: str
    shape: str
    quantization: str
    overrides: tuple[str, ...]
    runs: tuple[Run, ...]
    config: str | None = None
    """A deployment YAML the overrides apply to; None: the defaults."""
    skip: str | None = None
    """Why it is not run (its runs are reported with this reason)."""


def variants(mode: Mode) -> list[Variant]:
    """The variants of ``RUN_NAMES`` in ``mode``."""
    c, dtype = mode.concurrency, (f"model.dtype={mode.dtype}",)

    def chat(label: str, shape: str, quantization: str) -> Variant:
        runs = (Run(f"{label}-c1", 1, 0), Run(f"{label}-c64", c, 0))
        overrides = (*dtype, f"model.quantization={quantization}", *mode.short)
        return Variant(label, shape, quantization, overrides, runs)

    long_overrides = (*dtype, "model.quantization=none", *mode.long)
    long_run = (Run("bf16-4k-c1", 1, mode.long_prompt), Run("bf16-4k-c64", c, mode.long_prompt))
    return [
        chat("bf16", mode.dense, "none"),
        chat("int8", mode.dense, "int8"),
        chat("int4", mode.dense, "int4"),
        Variant("bf16-4k", mode.dense, "none", long_overrides, long_run),
        chat("moe", mode.moe, "none"),
    ]


def config_variants(
    mode: Mode, config_dir: Path | None, memory_bytes: int | None, usable: float = 0.9
) -> list[Variant]:
    """One variant per ``config_dir/*h100.yaml``, on random weights of its model's shape; skipped
    (with the reason) in tiny mode, for an unknown checkpoint, or when weights plus KV pool exceed
    ``usable`` of ``memory_bytes``."""
    from myserve.bench.random_checkpoint import SHAPES, parameter_counts
    from myserve.config import load_config

    found = sorted(config_dir.glob("*h100.yaml")) if config_dir is not None and config_dir.is_dir() else []
    out = []
    for path in found:
        config = load_config(str(path))
        name, engine = path.stem, config.engine
        shape = CONFIG_SHAPES.get(config.model.checkpoint or "")
        concurrency = min(mode.concurrency, engine.max_num_seqs)
        runs = (Run(name, concurrency, 0),)
        skip = None
        if mode.name == "tiny":
            skip = "tiny mode: the deployment's own model and engine do not fit a tiny run (use --full)"
        elif shape is None:
            skip = f"no random shape for checkpoint {config.model.checkpoint!r} (device_plan.CONFIG_SHAPES)"
        else:
            cfg = SHAPES[shape]
            itemsize = _DTYPE_BYTES.get(config.model.dtype, 2)
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            kv_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * itemsize
            need = parameter_counts(shape)[0] * itemsize + (engine.num_pages or 0) * engine.page_size * kv_token
            if memory_bytes is None or need > usable * memory_bytes:
                have = "unknown" if memory_bytes is None else f"{usable * memory_bytes / 2**30:.1f} GiB usable"
                skip = f"needs {need / 2**30:.1f} GiB (weights + KV pool), the device has {have}"
        quantization = "none" if config.model.quantization == "auto" else config.model.quantization
        out.append(Variant(name, shape or "", quantization, (), runs, config=str(path), skip=skip))
    return out
