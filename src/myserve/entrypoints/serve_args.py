"""The command line of ``serve`` (and ``run_batch``): our flags, ``vllm serve``'s (``vllm_flags``),
the model positional, and the deployment config they make (``config_from_args``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from myserve.config import QUANTIZATIONS, REASONING_PARSERS, TOOL_CALL_PARSERS
from myserve.config.engine import KV_CACHE_DTYPES
from myserve.entrypoints.vllm_flags import (
    DTYPE_NAMES,
    add_other_flags,
    check_other_flags,
    expand_vllm_config,
    parse_size,
    task_of,
)
from myserve.errors import ConfigError

if TYPE_CHECKING:
    from myserve.config import Config


# vLLM-style flag -> config key (MODEL, --model and --hf-checkpoint: ``_model_of``).
_FLAGS = {
    "chat_template": "model.chat_template",
    "max_model_len": "model.max_model_len",
    "dtype": "model.dtype",
    "quantization": "model.quantization",
    "max_num_seqs": "engine.max_num_seqs",
    "tensor_parallel_size": "mesh.model",
    "data_parallel_size": "mesh.data",
    "expert_parallel_size": "mesh.expert",
    "host": "server.host",
    "port": "server.port",
    "served_model_name": "server.served_model_name",
    "api_key": "server.api_key",
    "log_level": "server.log_level",
    "tool_call_parser": "server.tool_call_parser",
    "enable_auto_tool_choice": "server.enable_auto_tool_choice",
    "reasoning_parser": "server.reasoning_parser",
    "api_server_count": "server.api_server_count",
    "otlp_traces_endpoint": "server.otlp_traces_endpoint",
    "ray_replicas": "ray.replicas",
    "ray_min_replicas": "ray.min_replicas",
    "ray_max_replicas": "ray.max_replicas",
    "ray_address": "ray.address",
    "allowed_origins": "server.allowed_origins",
    "allowed_methods": "server.allowed_methods",
    "allowed_headers": "server.allowed_headers",
    "allow_credentials": "server.allow_credentials",
    "tokenizer": "model.tokenizer",
    "revision": "model.revision",
    "download_dir": "model.download_dir",
    "generation_config": "model.generation_config",
    "override_generation_config": "model.override_generation_config",
    "limit_mm_per_prompt": "model.limit_mm_per_prompt",
    "allowed_media_domains": "model.allowed_media_domains",
    "allowed_local_media_path": "model.allowed_local_media_path",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "kv_cache_memory_bytes": "engine.kv_cache_memory_bytes",
    "kv_cache_dtype": "engine.kv_cache_dtype",
    "kv_offloading_size": "engine.kv_offloading_size",
    "block_size": "engine.page_size",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "async_scheduling": "engine.async_scheduling",
    "seed": "engine.seed",
    "num_scheduler_steps": "engine.decode_steps",
    "max_logprobs": "server.max_logprobs",
    "enable_lora": "engine.enable_lora",
    "checkpoint_path": "model.checkpoint_path",
    "hf_config": "model.hf_config",
    "enable_weight_updates": "engine.enable_weight_updates",
    "enable_sleep_mode": "engine.enable_sleep_mode",
    "max_loras": "engine.max_loras",
    "max_lora_rank": "engine.max_lora_rank",
    "max_cpu_loras": "engine.max_cpu_loras",
    "lora_modules": "engine.lora_modules",
    "trust_request_chat_template": "server.trust_request_chat_template",
    "return_tokens_as_token_ids": "server.return_tokens_as_token_ids",
    "ssl_keyfile": "server.ssl_keyfile",
    "ssl_certfile": "server.ssl_certfile",
    "ssl_ca_certs": "server.ssl_ca_certs",
    "log_requests": "server.log_requests",
    "engine_process": "server.engine_process",
}


def parse_args(
    argv: Sequence[str] | None, prog: str = "python -m myserve.serve", description: str | None = None
) -> argparse.Namespace:
    """The command line (``vllm serve``'s flags among ours, ``vllm_flags``; a vLLM-style
    ``--config`` file is read as the flags it holds)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_config_flags(p)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", default=os.environ.get("MYSERVE_API_KEY"), help="or MYSERVE_API_KEY")
    p.add_argument("--max-logprobs", type=int, help="most top logprobs a request may ask for (at most 20)")
    p.add_argument(
        "--trust-request-chat-template",
        action="store_const",
        const=True,
        help="accept a chat_template field in requests (server.trust_request_chat_template)",
    )
    p.add_argument(
        "--return-tokens-as-token-ids",
        action="store_const",
        const=True,
        help="logprobs name tokens token_id:<id> (server.return_tokens_as_token_ids)",
    )
    p.add_argument("--ssl-keyfile", help="HTTPS: the private key file (PEM)")
    p.add_argument("--ssl-certfile", help="HTTPS: the certificate chain file (PEM)")
    p.add_argument("--ssl-ca-certs", help="HTTPS: CA file client certificates must be signed by")
    logs = p.add_mutually_exclusive_group()
    logs.add_argument("--disable-log-requests", dest="log_requests", action="store_const", const=False)
    logs.add_argument("--enable-log-requests", dest="log_requests", action="store_const", const=True)
    p.add_argument(
        "--disable-frontend-multiprocessing",
        dest="engine_process",
        action="store_const",
        const=False,
        help="run the engine in the API server's process (server.engine_process: false)",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--api-server-count", type=int, help="HTTP front-end processes sharing the port (default 1)")
    p.add_argument("--ray-replicas", type=int, help="serve N engine replicas on Ray Serve (needs myserve[ray])")
    p.add_argument("--ray-min-replicas", type=int, help="Ray Serve autoscaling: the fewest replicas")
    p.add_argument("--ray-max-replicas", type=int, help="Ray Serve autoscaling: the most replicas")
    p.add_argument("--ray-address", help="the Ray cluster to join (default: a local one)")
    p.add_argument("--otlp-traces-endpoint", help="OTLP collector receiving a span per request (needs myserve[otel])")
    for what in ("origins", "methods", "headers"):  # JSON lists, as vLLM spells them
        p.add_argument(f"--allowed-{what}", type=_json_list, help=f"CORS: allowed {what}, e.g. '[\"*\"]' (the default)")
    p.add_argument("--allow-credentials", action="store_const", const=True, help="CORS: allow cookies and HTTP auth")
    p.add_argument(
        "--add-model",
        action="append",
        default=[],
        metavar="SPEC",
        help="serve another model too (repeatable): comma-separated keys of a models entry, e.g. "
        "'checkpoint=/models/x,served_model_name=x,engine.num_pages=512' (model.* keys may drop 'model.'), "
        "or a YAML file holding one entry",
    )
    add_other_flags(p)
    return p.parse_args(expand_vllm_config(sys.argv[1:] if argv is None else argv))


def _json_list(text: str) -> list[str]:
    """A ``--allowed-*`` value: a JSON list of strings (``'["http://a.example"]'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


def _lora_module(text: str) -> str:
    """A ``--lora-modules`` item as ``name=path``: vLLM's ``name=path`` or its JSON object form
    (``{"name": ..., "path": ..., "base_model_name": ...}``; the base is the served model)."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError:
            item = None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
            raise argparse.ArgumentTypeError(f'expected {{"name": ..., "path": ...}}, got {text!r}')
        return f"{item['name']}={item['path']}"
    name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return text


def _config_dir(text: str) -> str:
    """``--hf-config``: a ``config.json`` names its directory."""
    return text[: -len("/config.json")] if text.endswith("/config.json") else text


_SPECULATIVE_KEYS = {
    "method": "engine.speculative_method",
    "num_speculative_tokens": "engine.num_speculative_tokens",
    "prompt_lookup_max": "engine.prompt_lookup_max",
    "prompt_lookup_min": "engine.prompt_lookup_min",
}


def _speculative(text: str) -> dict[str, object]:
    """``--speculative-config``'s JSON as config overrides: ``{"method": "ngram", ...}`` (prompt
    lookup) or ``{"model": DIR, "num_speculative_tokens": k}`` (a draft model)."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError:
        given = None
    if not isinstance(given, dict):
        raise ConfigError(f"--speculative-config: expected a JSON object, got {text!r}")
    model = given.get("model")
    method = given.get("method", "ngram" if model is None else "draft_model")
    if method == "[ngram]":
        method = "ngram"
    if method not in ("ngram", "draft_model"):
        raise ConfigError(f"--speculative-config: method {method!r} is not supported (ngram or draft_model)")
    if method == "draft_model" and not isinstance(model, str):
        raise ConfigError('--speculative-config: a draft model needs "model": a checkpoint directory or hub id')
    unknown = sorted(set(given) - set(_SPECULATIVE_KEYS) - {"model"})
    if unknown:
        raise ConfigError(f"--speculative-config: unsupported keys {', '.join(unknown)}")
    overrides: dict[str, object] = {key: given[name] for name, key in _SPECULATIVE_KEYS.items() if name in given}
    overrides["engine.speculative_method"] = method
    if method == "draft_model":
        overrides["engine.speculative_model"] = model
    return overrides


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose and size the model and engine (``--config``, ``--hf-checkpoint``,
    ``--set`` and the vLLM-style ones): shared by ``serve`` and ``run_batch``; read by
    ``config_from_args``."""
    p.add_argument(
        "--config",
        default=None,
        help="deployment YAML (default: config/smollm2-135m-cpu.yaml without a model, else the defaults), "
        "or vLLM's flat YAML of flags",
    )
    p.add_argument("model_arg", nargs="?", metavar="MODEL", help="HF directory, hub id or .gguf file (as --model)")
    p.add_argument("--model", help="HF directory, hub id or .gguf file: served under this name, with its defaults")
    p.add_argument("--hf-checkpoint", help="as --model")
    p.add_argument("--tokenizer", help="tokenizer source (directory, hub id or .gguf); default: the model's")
    p.add_argument("--checkpoint-path", help="serve the weights of this Orbax or Levanter checkpoint directory")
    p.add_argument(
        "--hf-config", type=_config_dir, help="config.json (or its directory or hub id) of --checkpoint-path's model"
    )
    p.add_argument("--revision", help="hub revision (branch, tag or commit) of a hub-id model")
    p.add_argument("--download-dir", help="hub cache directory (default: the Hugging Face cache)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", help="the model's name, then any aliases")
    p.add_argument("--chat-template", help="Jinja template file or text")
    p.add_argument("--max-model-len", type=parse_size, help="e.g. 4096, 32k (32,000), 32K (32,768)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    p.add_argument(
        "--gpu-memory-utilization", type=float, help="GPU/TPU: share of device memory for weights, KV and activations"
    )
    p.add_argument("--kv-cache-memory-bytes", type=parse_size, help="the KV pool's bytes per device, e.g. 4G")
    p.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="what the KV cache holds: auto (the model's dtype), int8, fp8"
    )
    p.add_argument("--kv-offloading-size", type=float, help="GiB of host memory holding prefix pages the device evicts")
    p.add_argument("--block-size", type=int, help="tokens per KV page (engine.page_size)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--seed", type=int, help="seeds the sampling seeds of requests that send none")
    p.add_argument("--num-scheduler-steps", type=int, help="decode tokens per device call (engine.decode_steps)")
    p.add_argument("--generation-config", help="request defaults: auto (the checkpoint's), vllm (none) or a directory")
    p.add_argument(
        "--override-generation-config", help="request defaults over those, as JSON: '{\"temperature\": 0.5}'"
    )
    p.add_argument("--limit-mm-per-prompt", help="images per prompt, as JSON: '{\"image\": 2}' (default 4)")
    p.add_argument("--allowed-media-domains", nargs="+", metavar="HOST", help="hosts of http(s) image URLs")
    p.add_argument("--allowed-local-media-path", help="a directory whose files may be sent as file:// image URLs")
    p.add_argument("--runner", choices=["auto", "generate", "pooling"], help="pooling: serve embeddings")
    p.add_argument("--convert", choices=["auto", "none", "embed"], help="embed: serve embeddings")
    p.add_argument("--task", choices=["auto", "generate", "embed", "embedding"], help="vLLM's older --runner")
    p.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATIONS,
        help="weights kept narrow on device: int8, int4 (GGUF blocks as stored), w8a8; auto = fastest here",
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int)
    p.add_argument("--data-parallel-size", "-dp", type=int, help="data-parallel replicas (mesh.data)")
    p.add_argument(
        "--expert-parallel-size", type=int, help="devices a MoE model's experts are split over (mesh.expert)"
    )
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, help="how tool calls are read from the text")
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_const",
        const=True,
        help="serve tool_choice auto (needs --tool-call-parser)",
    )
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, help="split <think> blocks off as reasoning")
    p.add_argument("--enable-lora", action="store_const", const=True, help="serve LoRA adapters (engine.enable_lora)")
    p.add_argument("--max-loras", type=int, help="adapters resident on the device at once (engine.max_loras)")
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank served (engine.max_lora_rank)")
    p.add_argument("--max-cpu-loras", type=int, help="adapters kept read on the host (engine.max_cpu_loras)")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        metavar="NAME=PATH",
        help='adapters served from the start: name=path, or JSON {"name": ..., "path": ...}',
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}\'',
    )
    p.add_argument(
        "--enable-weight-updates",
        action="store_const",
        const=True,
        help="take new weights while serving: POST /update_weights_from_disk (engine.enable_weight_updates)",
    )
    p.add_argument(
        "--enable-sleep-mode",
        action="store_const",
        const=True,
        help="serve POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping (engine.enable_sleep_mode)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config key")


def config_from_args(args: argparse.Namespace) -> Config:
    """The deployment config: the YAML (or the default), then the flags and ``--set`` overrides.

    Flags and ``--set`` overrides are applied together, so their combination is validated once.
    Raises ``ConfigError`` with a one-line message.
    """
    from myserve.config import config_from_dict, load_config, parse_overrides, with_overrides

    check_other_flags(args)
    overrides = {key: value for flag, key in _FLAGS.items() if (value := getattr(args, flag, None)) is not None}
    if getattr(args, "speculative_config", None) is not None:
        overrides.update(_speculative(args.speculative_config))
    model = _model_of(args)
    if model is not None:
        overrides["model.checkpoint"] = model
        # vLLM serves a model under the id or path it was given.
        overrides.setdefault("server.served_model_name", [model])
    if "model.dtype" in overrides:
        overrides["model.dtype"] = DTYPE_NAMES.get(str(overrides["model.dtype"]), overrides["model.dtype"])
    task = task_of(getattr(args, "runner", None), getattr(args, "convert", None), getattr(args, "task", None))
    if task is not None:
        overrides["model.task"] = task
    names = overrides.get("server.served_model_name")
    if isinstance(names, list):  # nargs="+": one name stays a plain name
        overrides["server.served_model_name"] = names[0] if len(names) == 1 else names
    overrides.update(parse_overrides(args.set))
    if args.config is None and model is not None:
        # A model named on the command line gets its own defaults (dtype, context length, a KV
        # pool sized from memory, the platform's step budget), not the bundled model's deployment.
        config = config_from_dict({}, "defaults")
    else:
        config = load_config(args.config)
    config = with_overrides(config, overrides, source="command line") if overrides else config
    added = getattr(args, "add_model", None)
    return add_models(config, added) if added else config


def _model_of(args: argparse.Namespace) -> str | None:
    """The model named by MODEL, ``--model`` or ``--hf-checkpoint`` (all three must agree)."""
    given = {v for v in (getattr(args, "model_arg", None), getattr(args, "model", None), args.hf_checkpoint) if v}
    if len(given) > 1:
        raise ConfigError(f"MODEL, --model and --hf-checkpoint name different models: {', '.join(sorted(given))}")
    return given.pop() if given else None


def add_models(config: Config, specs: Sequence[str]) -> Config:
    """``config`` serving one more model per ``--add-model`` spec, after its own model (or after the
    entries of its ``models``). Each entry inherits the top-level model, engine and mesh keys it
    does not set. Raises ``ConfigError`` naming the spec."""
    from myserve.config import MODEL_SECTIONS, ModelEntry, from_mapping
    from myserve.config.fields import inherit

    entries = list(config.models)
    server = config.server
    if not entries:  # the model the other flags describe comes first, under its own name
        entries.append(
            ModelEntry(
                model=config.model, engine=config.engine, mesh=config.mesh, served_model_name=server.served_model_name
            )
        )
        server = dataclasses.replace(server, served_model_name=None)
    top = {section: dataclasses.asdict(getattr(config, section)) for section in MODEL_SECTIONS}
    for spec in specs:
        data = inherit(top, _entry_mapping(spec), MODEL_SECTIONS)
        entries.append(from_mapping(ModelEntry, data, f"--add-model {spec!r}"))  # type: ignore[arg-type]
    try:
        return dataclasses.replace(config, server=server, models=tuple(entries))
    except ConfigError as e:
        raise ConfigError(f"--add-model: {e}") from None


_ENTRY_ITEM = re.compile(r",(?=\s*[A-Za-z_][\w.]*\s*=)")
"""Splits ``a=1,b.c=[1,2]`` at the commas that start a key, not at those inside a value."""


def _entry_mapping(spec: str) -> dict[str, Any]:
    """One ``--add-model`` spec as a ``models`` entry mapping: ``key=value`` items (values read as
    YAML; ``model.`` may be left off model keys; ``hf_checkpoint`` means ``model.checkpoint``), or
    the path of a YAML file holding one entry."""
    from myserve.config import ModelConfig, ModelEntry, parse_overrides

    if "=" not in spec:
        try:
            loaded = yaml.safe_load(Path(spec).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            reason = " ".join(str(e).split())
            raise ConfigError(
                f"--add-model {spec!r}: not key=value items, nor a readable YAML file ({reason})"
            ) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--add-model {spec!r}: the file must hold one mapping (a models entry)")
        return loaded
    entry_keys = {f.name for f in dataclasses.fields(ModelEntry)}
    model_keys = {f.name for f in dataclasses.fields(ModelConfig)}
    data: dict[str, Any] = {}
    for key, value in parse_overrides(_ENTRY_ITEM.split(spec)).items():
        key = "model.checkpoint" if key == "hf_checkpoint" else key
        if "." not in key and key not in entry_keys and key in model_keys:
            key = f"model.{key}"
        *sections, leaf = key.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--add-model {spec!r}: '{section}' is not a section")
        node[leaf] = value
    return data
