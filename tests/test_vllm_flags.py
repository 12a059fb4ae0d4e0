"""``myserve serve`` reads ``vllm serve``'s command line (host only, milliseconds): each flag that
means the same sets its config key, a model named on the command line gets its own defaults and
name, flags with no meaning here are accepted with a log line, unsupported ones are refused naming
the flag, vLLM's flat ``--config`` YAML is read as flags (the command line winning), and the
README's table is the module's."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from myserve.entrypoints import serve
from myserve.entrypoints.vllm_flags import OTHERS, SAME, markdown_table, parse_size
from myserve.errors import ConfigError

HOT = '{"temperature": 0.5}'
README = Path(__file__).resolve().parents[1] / "README.md"


def config_of(*argv: str):
    return serve.config_from_args(serve.parse_args(list(argv)))


def value_of(config, key: str):
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def test_vllm_quick_start_flags() -> None:
    config = config_of(
        "Qwen/Qwen2.5-1.5B-Instruct", "--gpu-memory-utilization", "0.8", "--max-num-batched-tokens", "1024",
        "--seed", "7", "--dtype", "auto", "--api-key", "token-abc123", "--generation-config", "auto",
        "--max-model-len", "32k", "-tp", "2", "--no-enable-prefix-caching", "--block-size", "32",
    )  # fmt: skip
    assert config.model.checkpoint == "Qwen/Qwen2.5-1.5B-Instruct"
    assert config.server.served_model_name == "Qwen/Qwen2.5-1.5B-Instruct"  # the id as given, like vLLM
    assert config.engine.gpu_memory_utilization == 0.8 and config.engine.max_num_batched_tokens == 1024
    assert config.engine.seed == 7 and config.server.api_key == "token-abc123"
    assert config.model.max_model_len == 32000 and config.mesh.model == 2 and config.engine.page_size == 32
    assert config.engine.enable_prefix_caching is False
    # Its own defaults, not the bundled CPU deployment's: KV sized from memory, the platform's budget.
    assert config.engine.num_pages is None and config.model.dtype == "auto"
    assert config.engine.token_buckets == () and config.engine.decode_steps == 0


def test_model_positional_or_flag_and_the_bundled_default() -> None:
    assert config_of("--model", "/models/x").model.checkpoint == "/models/x"
    assert config_of("--hf-checkpoint", "/models/x", "--served-model-name", "a", "b").server.served_model_name == (
        "a",
        "b",
    )
    with pytest.raises(ConfigError, match="name different models"):
        config_of("/models/x", "--model", "/models/y")
    bundled = config_of()  # no model: the bundled SmolLM2 deployment, as before
    assert bundled.model.checkpoint is None and bundled.engine.num_pages == 2048
    # A model with a deployment YAML takes the YAML's engine.
    assert config_of("/models/x", "--config", "config/smollm2-135m-cpu.yaml").engine.num_pages == 2048


PARTNERS = {
    "--ssl-keyfile": ["--ssl-certfile", "c.pem"],
    "--ssl-certfile": ["--ssl-keyfile", "k.pem"],
    "--ssl-ca-certs": ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"],
    "--enable-auto-tool-choice": ["--tool-call-parser", "hermes"],
    "--lora-modules": ["--enable-lora"],
}
"""Flags that need another to be valid."""


@pytest.mark.parametrize("flag", [f for f in SAME if f.key and f.example is not None], ids=lambda f: f.name)
def test_every_same_flag_sets_its_key(flag) -> None:
    argv = [flag.example] if flag.name == "model" else [flag.name, flag.example]
    argv += PARTNERS.get(flag.name, [])
    config = config_of(*argv)
    value = value_of(config, flag.key)
    assert value not in (None, ()), flag.name
    assert str(flag.example).strip('"[]*') in str(value) or flag.key in (
        "model.task",
        "model.max_model_len",
        "engine.kv_cache_memory_bytes",
        "model.override_generation_config",
        "engine.speculative_method",
    ), (flag.name, value)


@pytest.mark.parametrize(
    ("argv", "key", "value"),
    [
        (["--enable-prefix-caching"], "engine.enable_prefix_caching", True),
        (["--no-async-scheduling"], "engine.async_scheduling", False),
        (["--disable-log-requests"], "server.log_requests", False),
        (["--enable-log-requests"], "server.log_requests", True),
        (["--disable-frontend-multiprocessing"], "server.engine_process", False),
        (["--runner", "pooling"], "model.task", "embed"),
        (["--convert", "embed"], "model.task", "embed"),
        (["--task", "embedding"], "model.task", "embed"),
        (["--dtype", "half"], "model.dtype", "float16"),
        (['--speculative-config', '{"model": "/d", "num_speculative_tokens": 3}'], 'engine.speculative_model', '/d'),
        (["--speculative-config", '{"model": "/draft"}'], "engine.speculative_method", "draft_model"),
        (["--enable-lora"], "engine.enable_lora", True),
        (
            ["--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'],
            "engine.lora_modules",
            ("a=/x", "b=/y"),
        ),
        (["--dtype", "float"], "model.dtype", "float32"),
        (["--kv-cache-memory-bytes", "2G"], "engine.kv_cache_memory_bytes", 2 << 30),
        (["--num-scheduler-steps", "8"], "engine.decode_steps", 8),
        (["--override-generation-config", HOT], "model.override_generation_config", HOT),
    ],
)  # fmt: skip
def test_switches_and_spellings(argv: list[str], key: str, value: object) -> None:
    assert value_of(config_of("/models/x", *argv), key) == value


def test_flags_with_no_meaning_here_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="myserve.serve"):
        config_of("/models/x", "--enforce-eager", "--trust-remote-code", "--swap-space", "4", "--load-format", "auto")
    said = caplog.text
    assert "--enforce-eager has no meaning here" in said and "--trust-remote-code has no meaning here" in said
    assert "--swap-space has no meaning here" in said


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: only 1 is supported"),
        (["--speculative-config", '{"method": "draft_model"}'], "--speculative-config: a draft model needs"),
        (["--speculative-config", '{"method": "eagle"}'], "--speculative-config: method 'eagle' is not supported"),
    ],
)
def test_unsupported_flags_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        config_of("/models/x", *argv)
    config_of("/models/x", "--pipeline-parallel-size", "1", "--kv-cache-dtype", "auto")  # the "off" values pass


def test_bad_values_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--max-model-len", "lots"], ["--quantization", "awq"], ["--runner", "draft"]):
        with pytest.raises(SystemExit):
            serve.parse_args(["/models/x", *argv])
        assert argv[0] in capsys.readouterr().err
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        config_of("/models/x", "--gpu-memory-utilization", "1.5")
    with pytest.raises(ConfigError, match="max_logprobs must be in 0..20"):
        config_of("/models/x", "--max-logprobs", "50")
    with pytest.raises(ConfigError, match="unknown field 'temp'"):
        config_of("/models/x", "--override-generation-config", '{"temp": 1}')


def test_vllm_yaml_config_is_read_as_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    path = tmp_path / "vllm.yaml"
    path.write_text(
        "model: org/tiny\nport: 8123\ngpu-memory-utilization: 0.7\nmax_num_seqs: 8\n"
        "enable-prefix-caching: false\nserved-model-name: [tiny, alias]\nenforce-eager: true\n"
    )
    config = config_of("--config", str(path), "--port", "9000")
    assert config.model.checkpoint == "org/tiny" and config.server.port == 9000
    assert config.engine.gpu_memory_utilization == 0.7 and config.engine.max_num_seqs == 8
    assert config.engine.enable_prefix_caching is False and config.server.served_model_name == ("tiny", "alias")
    # Our own sectioned YAML is still ours.
    ours = tmp_path / "ours.yaml"
    ours.write_text("engine: {num_pages: 64}\nserver: {port: 8124}\n")
    assert config_of("--config", str(ours)).engine.num_pages == 64
    # ... every section of it (the shipped default holds them all).
    shipped = Path(__file__).resolve().parents[1] / "config" / "smollm2-135m-cpu.yaml"
    assert config_of("--config", str(shipped)).ray.replicas == 0


def test_parse_size() -> None:
    assert [parse_size(s) for s in ("4096", "32k", "32K", "1m", "1M", "4G", "1.5k")] == [
        4096, 32000, 32768, 1000000, 1048576, 4 << 30, 1500,
    ]  # fmt: skip
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("4 GiB")


def test_every_flag_in_the_table_is_accepted() -> None:
    for flag in OTHERS:
        argv = [flag.name, *((flag.allowed[0] if flag.allowed else "x",) if flag.takes_value else ())]
        args = serve.parse_args(["/models/x", *argv])  # parses: no "unrecognized arguments"
        assert args is not None


def test_readme_table_is_the_modules() -> None:
    assert markdown_table() in README.read_text(), "README's vLLM table is stale: paste vllm_flags.markdown_table()"
