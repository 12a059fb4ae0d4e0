"""``vllm serve``'s command line, as ``myserve serve`` reads it: which flags mean the same here
(and which config key each sets), which have no meaning here (accepted, with one log line), and
which are not supported yet (refused in one line naming the flag, unless given the value that
means "off"). The README's "Coming from vLLM" table is ``markdown_table()`` (a test keeps it so).

Also vLLM's ``--config`` file: a flat YAML of flag names (``port: 8001``,
``gpu-memory-utilization: 0.8``), read as those flags written before the command line's own (which
win), beside our own sectioned deployment YAML.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import yaml

from myserve.errors import ConfigError

logger = logging.getLogger("myserve.serve")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One vLLM flag and what ``myserve serve`` does with it."""

    name: str
    """The flag as vLLM spells it (its first spelling)."""
    status: str
    """``same`` (same meaning), ``ignored`` (no meaning here: accepted, logged), ``partly`` (only
    the values in ``allowed``; others refused) or ``not yet`` (refused unless ``allowed``)."""
    key: str = ""
    """The config key it sets (``same``)."""
    note: str = ""
    """What it does here, or why not."""
    example: str | None = None
    """A value for the README and the tests (``same`` flags that take one)."""
    allowed: tuple[str, ...] = ()
    """Values accepted by a ``partly`` or ``not yet`` flag (vLLM's default, i.e. the feature off)."""
    takes_value: bool = True
    """False for an on/off switch (``--enforce-eager``)."""


SAME = [
    Flag("model", "same", "model.checkpoint", "positional or --model: HF directory, hub id or .gguf file", "org/name"),
    Flag("--tokenizer", "same", "model.tokenizer", "", "org/name"),
    Flag("--revision", "same", "model.revision", "hub revision of the checkpoint", "main"),
    Flag("--download-dir", "same", "model.download_dir", "hub cache directory", "/models"),
    Flag("--dtype", "same", "model.dtype", "auto, bfloat16, float16 (half), float32 (float)", "bfloat16"),
    Flag("--max-model-len", "same", "model.max_model_len", "also 32k, 1M", "4096"),
    Flag(
        "--kv-cache-dtype",
        "same",
        "engine.kv_cache_dtype",
        "auto, fp8 (= fp8_e4m3), fp8_e5m2, or int8: a byte per value, a scale per token and head",
        "fp8",
    ),
    Flag(
        "--quantization",
        "partly",
        "model.quantization",
        "int8, int4, w8a8 (weight-only narrow weights); not AWQ/GPTQ/FP8",
    ),
    Flag("--served-model-name", "same", "server.served_model_name", "first is the name, the rest aliases", "m"),
    Flag("--chat-template", "same", "model.chat_template", "file or text", "t.jinja"),
    Flag("--generation-config", "same", "model.generation_config", "auto, vllm or a directory", "vllm"),
    Flag(
        "--override-generation-config",
        "same",
        "model.override_generation_config",
        "JSON object",
        '{"temperature": 0.5}',
    ),
    Flag(
        "--limit-mm-per-prompt",
        "same",
        "model.limit_mm_per_prompt",
        "JSON object; images only (LLaVA, Gemma 3 and Qwen2.5-VL checkpoints)",
        '{"image": 2}',
    ),
    Flag("--allowed-media-domains", "same", "model.allowed_media_domains", "hosts of http(s) image URLs", "a.example"),
    Flag("--allowed-local-media-path", "same", "model.allowed_local_media_path", "file:// images under it", "/data"),
    Flag("--runner", "same", "model.task", "generate; pooling serves /v1/embeddings", "pooling"),
    Flag("--convert", "same", "model.task", "embed as --runner pooling", "embed"),
    Flag("--task", "same", "model.task", "vLLM's older spelling: generate, embed", "embed"),
    Flag("--gpu-memory-utilization", "same", "engine.gpu_memory_utilization", "KV pool sized from it", "0.8"),
    Flag("--kv-cache-memory-bytes", "same", "engine.kv_cache_memory_bytes", "KV pool bytes per device; 4G", "1G"),
    Flag(
        "--kv-offloading-size",
        "same",
        "engine.kv_offloading_size",
        "GiB of host memory for prefix pages the device evicts (the native backend)",
        "8",
    ),
    Flag("--block-size", "same", "engine.page_size", "tokens per KV page", "32"),
    Flag("--max-num-seqs", "same", "engine.max_num_seqs", "", "32"),
    Flag("--max-num-batched-tokens", "same", "engine.max_num_batched_tokens", "", "1024"),
    Flag(
        "--enable-prefix-caching",
        "same",
        "engine.enable_prefix_caching",
        "and --no-enable-prefix-caching",
        takes_value=False,
    ),
    Flag("--async-scheduling", "same", "engine.async_scheduling", "and --no-async-scheduling", takes_value=False),
    Flag("--seed", "same", "engine.seed", "seeds of requests that send none", "0"),
    Flag("--enable-lora", "same", "engine.enable_lora", "LoRA adapters (dense models' projections)", takes_value=False),
    Flag(
        "--enable-sleep-mode",
        "same",
        "engine.enable_sleep_mode",
        "POST /sleep?level=1 or 2, POST /wake_up, GET /is_sleeping",
        takes_value=False,
    ),
    Flag("--lora-modules", "same", "engine.lora_modules", "name=path or vLLM's JSON form", "sql=/adapters/sql"),
    Flag("--max-loras", "same", "engine.max_loras", "adapters on the device at once", "4"),
    Flag("--max-lora-rank", "same", "engine.max_lora_rank", "", "32"),
    Flag("--max-cpu-loras", "same", "engine.max_cpu_loras", "adapters kept read on the host", "8"),
    Flag(
        "--speculative-config",
        "same",
        "engine.speculative_method",
        "ngram (prompt lookup) or a draft model with the same vocabulary",
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}',
    ),
    Flag("--num-scheduler-steps", "same", "engine.decode_steps", "decode tokens per device call", "4"),
    Flag("--tensor-parallel-size", "same", "mesh.model", "-tp", "2"),
    Flag("--data-parallel-size", "same", "mesh.data", "-dp", "2"),
    Flag("--host", "same", "server.host", "", "0.0.0.0"),
    Flag("--port", "same", "server.port", "", "8001"),
    Flag("--api-key", "same", "server.api_key", "", "secret"),
    Flag("--max-logprobs", "same", "server.max_logprobs", "at most 20", "5"),
    Flag(
        "--return-tokens-as-token-ids",
        "same",
        "server.return_tokens_as_token_ids",
        "logprobs name tokens token_id:<id>",
        takes_value=False,
    ),
    Flag(
        "--trust-request-chat-template",
        "same",
        "server.trust_request_chat_template",
        "a request's chat_template",
        takes_value=False,
    ),
    Flag("--ssl-keyfile", "same", "server.ssl_keyfile", "with --ssl-certfile", "key.pem"),
    Flag("--ssl-certfile", "same", "server.ssl_certfile", "", "cert.pem"),
    Flag("--ssl-ca-certs", "same", "server.ssl_ca_certs", "client certificates then required", "ca.pem"),
    Flag("--disable-log-requests", "same", "server.log_requests", "no line per request", takes_value=False),
    Flag("--enable-log-requests", "same", "server.log_requests", "a line per request (the default)", takes_value=False),
    Flag(
        "--disable-frontend-multiprocessing",
        "same",
        "server.engine_process",
        "engine in the API process",
        takes_value=False,
    ),
    Flag("--api-server-count", "same", "server.api_server_count", "", "2"),
    Flag("--tool-call-parser", "partly", "server.tool_call_parser", "hermes, llama3_json, mistral"),
    Flag("--enable-auto-tool-choice", "same", "server.enable_auto_tool_choice", "", takes_value=False),
    Flag("--reasoning-parser", "partly", "server.reasoning_parser", "deepseek_r1, qwen3"),
    Flag("--otlp-traces-endpoint", "same", "server.otlp_traces_endpoint", "", "http://otel:4317"),
    Flag("--allowed-origins", "same", "server.allowed_origins", "JSON list", '["*"]'),
    Flag("--allowed-methods", "same", "server.allowed_methods", "JSON list", '["*"]'),
    Flag("--allowed-headers", "same", "server.allowed_headers", "JSON list", '["*"]'),
    Flag("--allow-credentials", "same", "server.allow_credentials", "", takes_value=False),
    Flag("--config", "same", "", "vLLM's flat YAML of flags, or our sectioned deployment YAML", "serve.yaml"),
]
"""Flags that mean here what they mean in vLLM (the ``partly`` ones for some of vLLM's values)."""

OTHERS = [
    Flag(
        "--enforce-eager",
        "ignored",
        note="steps are always compiled XLA executables; there is no eager mode to force",
        takes_value=False,
    ),
    Flag(
        "--trust-remote-code",
        "ignored",
        note="architectures are built in: a checkpoint's own code is never run",
        takes_value=False,
    ),
    Flag("--swap-space", "ignored", note="a preempted sequence is recomputed, never swapped to host memory"),
    Flag("--cpu-offload-gb", "ignored", note="weights stay on the device"),
    Flag("--max-seq-len-to-capture", "ignored", note="no CUDA graphs are captured by length"),
    Flag("--cuda-graph-sizes", "ignored", note="XLA decides its command buffers (engine.token_buckets sizes steps)"),
    Flag("--compilation-config", "ignored", note="XLA compiles every step; see engine.token_buckets"),
    Flag("--disable-custom-all-reduce", "ignored", note="collectives are XLA's", takes_value=False),
    Flag("--distributed-executor-backend", "ignored", note="one process per host on a JAX mesh"),
    Flag("--enable-chunked-prefill", "ignored", note="prompts are always chunked into steps", takes_value=False),
    Flag(
        "--disable-log-stats",
        "ignored",
        note="no periodic stats lines are logged; /metrics has them",
        takes_value=False,
    ),
    Flag("--tokenizer-mode", "ignored", note="the fast (Rust) tokenizer is always used"),
    Flag("--max-parallel-loading-workers", "ignored", note="tensors are read one at a time, straight to their devices"),
    Flag(
        "--load-format", "partly", allowed=("auto", "safetensors", "gguf"), note="the checkpoint's format is detected"
    ),
    Flag(
        "--pipeline-parallel-size", "partly", allowed=("1",), note="no pipeline parallelism; use --tensor-parallel-size"
    ),
    Flag(
        "--kv-offloading-backend", "partly", allowed=("native",), note="host memory (--kv-offloading-size); no LMCache"
    ),
    Flag("--scheduling-policy", "partly", allowed=("fcfs",), note="first come, first served"),
    Flag("--chat-template-content-format", "partly", allowed=("auto",), note="both content formats are read"),
    Flag("--enable-expert-parallel", "not yet", note="use --expert-parallel-size N (mesh.expert)", takes_value=False),
    Flag("--hf-token", "not yet", note="set HF_TOKEN in the environment instead"),
    Flag("--hf-overrides", "not yet", note="edit the checkpoint's config.json instead"),
    Flag("--root-path", "not yet", note="serve behind a proxy that strips the prefix"),
    Flag("--response-role", "not yet", note="responses are always role assistant"),
    Flag("--uvicorn-log-level", "not yet", note="--log-level sets uvicorn's level too"),
    Flag("--disable-uvicorn-access-log", "not yet", note="--log-level warning quiets it", takes_value=False),
    Flag("--disable-fastapi-docs", "not yet", note="/docs and /openapi.json are always served", takes_value=False),
    Flag("--middleware", "not yet", note="no user middleware"),
    Flag(
        "--enable-prompt-tokens-details",
        "ignored",
        note="usage always has prompt_tokens_details.cached_tokens",
        takes_value=False,
    ),
]
"""Flags accepted only to say they have no meaning here, or that they are not supported yet."""

DTYPE_NAMES = {"half": "float16", "float": "float32"}
"""vLLM's other names of dtypes."""


def add_other_flags(p: argparse.ArgumentParser) -> None:
    """Add the ``OTHERS`` flags (read by ``check_other_flags``)."""
    for flag in OTHERS:
        dest = "vllm_" + flag.name.lstrip("-").replace("-", "_")
        if flag.takes_value:
            p.add_argument(flag.name, dest=dest, metavar="VALUE", help=argparse.SUPPRESS)
        else:
            p.add_argument(flag.name, dest=dest, action="store_const", const="true", help=argparse.SUPPRESS)


def check_other_flags(args: argparse.Namespace) -> None:
    """Log each ignored flag given; raise ``ConfigError`` naming the first unsupported one."""
    for flag in OTHERS:
        value = getattr(args, "vllm_" + flag.name.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        if flag.status == "ignored":
            logger.info("%s has no meaning here (%s): ignored", flag.name, flag.note)
        elif value not in flag.allowed:
            given = f"{flag.name} {value}" if flag.takes_value else flag.name
            why = f"only {', '.join(flag.allowed)} is supported" if flag.allowed else "not supported yet"
            raise ConfigError(f"{given}: {why}" + (f"; {flag.note}" if flag.note else ""))


def parse_size(text: str) -> int:
    """A count with vLLM's suffixes: ``32k`` = 32,000, ``32K`` = 32,768 (binary), ``1M``, ``4G``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a number such as 4096, 32k or 4G, got {text!r}")
    number, suffix = float(m.group(1)), m.group(2)
    power = " kmgt".index(suffix.lower()) if suffix else 0
    base = 1024 if suffix.isupper() else 1000
    value = number * base**power
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


def task_of(runner: str | None, convert: str | None, task: str | None) -> str | None:
    """``model.task`` from vLLM's ``--runner``, ``--convert`` and older ``--task``; None = unchanged."""
    if runner == "pooling" or convert == "embed" or task in ("embed", "embedding"):
        return "embed"
    if runner == "generate" or task == "generate":
        return "generate"
    return None


def expand_vllm_config(argv: Sequence[str]) -> list[str]:
    """``argv`` with a vLLM-style ``--config FILE`` (flat flag names, as ``vllm serve --config``
    reads) replaced by the flags it holds, written first so that the command line's own win. A
    sectioned myserve deployment YAML is left to ``--config`` itself."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path, span = argv[i + 1], 2
        elif arg.startswith("--config="):
            path, span = arg.split("=", 1)[1], 1
        else:
            continue
        flags = _vllm_config_flags(Path(path))
        if flags is None:
            return argv
        return [*flags, *argv[:i], *argv[i + span :]]
    return argv


def _vllm_config_flags(path: Path) -> list[str] | None:
    """The flags of a vLLM-style config file, or None when it is a myserve deployment YAML."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None  # --config reports it in its own words
    if not isinstance(data, dict) or not data:
        return None
    from myserve.config import Config  # (not at import: the CLI's other modules import this one first)

    sections = {f.name for f in dataclasses.fields(Config)}  # every section a deployment YAML may hold
    ours = all(k in sections and isinstance(v, dict | list | None) for k, v in data.items())
    if ours:
        return None
    flags: list[str] = []
    for key, value in data.items():
        name = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            flags += [name] if value else ([f"--no-{name[2:]}"] if name in _NEGATABLE else [])
        elif isinstance(value, list):
            flags += [name, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [name, json.dumps(value)]
        elif value is not None:
            flags += [name, str(value)]
    logger.info("%s: read as vLLM flags: %s", path, " ".join(flags))
    return flags


_NEGATABLE = {"--enable-prefix-caching", "--async-scheduling"}
"""Switches that also take vLLM's ``--no-`` form."""


def markdown_table() -> str:
    """The README's table of vLLM's flags and what ``myserve serve`` does with each."""
    words = {"same": "same", "partly": "some values", "ignored": "accepted, no meaning here", "not yet": "not yet"}
    lines = ["| vLLM flag | here | config key / note |", "|---|---|---|"]
    for flag in [*SAME, *OTHERS]:
        what = " — ".join(part for part in (f"`{flag.key}`" if flag.key else "", flag.note) if part)
        if flag.allowed:
            what = f"accepts {', '.join(flag.allowed)}; {what}"
        lines.append(f"| `{flag.name}` | {words[flag.status]} | {what} |")
    return "\n".join(lines)
