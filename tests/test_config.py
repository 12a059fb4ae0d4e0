"""Deployment config: defaults, YAML and override loading, type coercion, one-line errors, field docs."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from myserve.config import (
    Config,
    EngineConfig,
    MeshConfig,
    ModelConfig,
    ModelEntry,
    RayConfig,
    ServerConfig,
    config_from_dict,
    default_config_path,
    from_mapping,
    load_config,
    parse_overrides,
    with_overrides,
)
from myserve.config import schema as config_module
from myserve.config.fields import field_docs, key_docs
from myserve.errors import ConfigError, MyserveError

REPO_DEFAULT = Path(__file__).resolve().parents[1] / "config" / "smollm2-135m-cpu.yaml"
SECTIONS = (ModelConfig, EngineConfig, ServerConfig, MeshConfig, RayConfig, ModelEntry, Config)


def expected_default() -> Config:
    return Config(
        model=ModelConfig(checkpoint=None, dtype="auto", max_model_len=2048),
        engine=EngineConfig(
            page_size=16,
            num_pages=2048,
            attention_backend="auto",
            max_num_batched_tokens=256,
            token_buckets=(1, 4, 8, 16, 32, 64, 128, 256),
            context_buckets=(128, 512, 2048),
        ),
        server=ServerConfig(host="127.0.0.1", port=8000, served_model_name="SmolLM2-135M-Instruct"),
        mesh=MeshConfig(data=1, model=1),
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


def error_of(fn, *args, **kwargs) -> str:
    """Run ``fn`` expecting a ConfigError; return its message after checking it is one line."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- defaults -------------------------------------------------------------------------------


def test_default_load_is_the_cpu_deployment() -> None:
    assert default_config_path() == REPO_DEFAULT
    config = load_config()
    assert config == expected_default()
    assert config.engine.num_pages == 2048 and config.model.dtype == "auto"
    assert config.server.served_model_name == "SmolLM2-135M-Instruct"


def test_builtin_default_equals_yaml_when_file_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "default_config_path", lambda: None)
    assert load_config() == load_config(REPO_DEFAULT) == expected_default()


def test_default_yaml_spells_out_and_comments_every_key() -> None:
    data = yaml.safe_load(REPO_DEFAULT.read_text())
    keys = {f"{section}.{key}" for section, fields in data.items() if isinstance(fields, dict) for key in fields}
    lists = {section for section, value in data.items() if isinstance(value, list)}  # models
    assert keys | lists == set(key_docs(Config)) and lists == {"models"}
    for line in REPO_DEFAULT.read_text().splitlines():
        if line.startswith("  ") and ":" in line:
            assert "#" in line, f"key without a comment: {line!r}"


def test_dataclass_defaults() -> None:
    config = Config()
    assert config.engine == EngineConfig(page_size=16, num_pages=None, attention_backend="auto")
    assert config.engine.max_num_batched_tokens is None  # sized by the platform (256 on CPU, 2048 on GPU/TPU)
    assert config.model.dtype == "auto" and config.server.log_level == "info"
    assert config_from_dict({}, "empty") == config


# --- loading and overrides ------------------------------------------------------------------


def test_yaml_round_trip(tmp_path: Path) -> None:
    config = Config(
        model=ModelConfig(checkpoint="/ckpt/llama", tokenizer="tok", dtype="bfloat16", max_model_len=4096),
        engine=EngineConfig(page_size=64, num_pages=4, attention_backend="pallas", compilation_cache_dir="/c"),
        server=ServerConfig(host="0.0.0.0", port=9000, api_key="sk-1", log_level="debug"),
        mesh=MeshConfig(data=2, model=4),
    )
    path = write(tmp_path, yaml.safe_dump(dataclasses.asdict(config)))
    assert load_config(path) == config
    assert load_config(str(path)) == config


def test_partial_file_keeps_defaults_and_empty_sections(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  page_size: 32\nmesh:\n")
    assert load_config(path) == Config(engine=EngineConfig(page_size=32))
    assert load_config(write(tmp_path, "# nothing but a comment\n")) == Config()


def test_overrides_are_parsed_as_yaml_and_applied_after_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  checkpoint: /ckpt\nengine:\n  page_size: 32\n")
    overrides = ["model.max_model_len=2048", "model.checkpoint=null", "mesh.model=2", "engine.page_size=64"]
    config = load_config(path, overrides)
    assert config.model.max_model_len == 2048
    assert config.model.checkpoint is None
    assert config.mesh.model == 2 and config.engine.page_size == 64


def test_parse_overrides() -> None:
    parsed = parse_overrides(["a.b=1", "a.c = x=y", "a.d=null", "a.e={{ x", "a.f=[1, 2]", "a.g='7'"])
    assert parsed == {"a.b": 1, "a.c": "x=y", "a.d": None, "a.e": "{{ x", "a.f": [1, 2], "a.g": "7"}
    with pytest.raises(TypeError):
        parse_overrides("a.b=1")


def test_with_overrides_returns_a_new_validated_config() -> None:
    base = Config()
    changed = with_overrides(base, {"engine.page_size": 32, "server.port": 8080.0})
    assert changed.engine.page_size == 32 and changed.server.port == 8080
    assert isinstance(changed.server.port, int)
    assert base.engine.page_size == 16
    assert with_overrides(base, {}) == base
    message = error_of(with_overrides, base, {"model.max_model_len": 0}, source="--max-model-len")
    assert message == "--max-model-len: model.max_model_len must be >= 1, got 0"


def test_request_timeout_is_off_by_default_and_takes_seconds() -> None:
    assert Config().server.request_timeout_s is None and load_config().server.request_timeout_s is None
    timeout = load_config(None, ["server.request_timeout_s=2"]).server.request_timeout_s
    assert timeout == 2.0 and isinstance(timeout, float)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "engine.page_sise=32",
            "overrides: unknown key 'engine.page_sise' (did you mean 'engine.page_size'?); "
            "known keys: page_size, num_pages, gpu_memory_utilization, kv_cache_memory_bytes, attention_backend, "
            "moe_backend, quantized_matmul, kv_cache_dtype, compilation_cache_dir, max_num_seqs, "
            "max_num_batched_tokens, max_waiting, token_buckets, context_buckets, "
            "decode_steps, decode_call_budget_ms, enable_prefix_caching, kv_offloading_size, "
            "async_scheduling, seed, enable_lora, "
            "max_loras, max_lora_rank, "
            "max_cpu_loras, lora_modules, enable_sleep_mode, enable_weight_updates, speculative_method, "
            "speculative_model, "
            "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min",
        ),
        (
            "egnine.page_size=32",
            "overrides: unknown section 'egnine' (did you mean 'engine'?); known sections: model, engine, server, "
            "mesh, ray, models",
        ),
        ("engine.page_size=abc", "overrides: engine.page_size: expected int, got 'abc' (str)"),
        ("engine.page_size=true", "overrides: engine.page_size: expected int, got True (bool)"),
        ("engine.page_size=16.5", "overrides: engine.page_size: expected int, got 16.5 (float)"),
        ("model.max_model_len=x", "overrides: model.max_model_len: expected int or null, got 'x' (str)"),
        (
            "server.api_key=12345",
            "overrides: server.api_key: expected str or null, got 12345 (int); quote it to make it a string",
        ),
        ("engine.page_size=12", "overrides: engine.page_size must be a power of two >= 1, got 12"),
        ("engine.num_pages=1", "overrides: engine.num_pages must be >= 2, got 1"),
        ("engine.decode_steps=65", "overrides: engine.decode_steps must be in [0, 64], got 65"),
        (
            "engine.context_buckets=[2048,512]",
            "overrides: engine.context_buckets must be increasing positive integers, got [2048, 512]",
        ),
        (
            "engine.page_buckets=[8]",
            "overrides: 'engine.page_buckets' was removed: set engine.context_buckets (context lengths the "
            "attention is compiled for)",
        ),
        (
            "engine.batch_buckets=[1,8]",
            "overrides: 'engine.batch_buckets' was removed: a step is one ragged batch of tokens; set "
            "engine.token_buckets instead",
        ),
        (
            "engine.token_buckets=[8,4]",
            "overrides: engine.token_buckets must be increasing positive integers, got [8, 4]",
        ),
        ("server.port=70000", "overrides: server.port must be in 1..65535, got 70000"),
        ("server.request_timeout_s=0", "overrides: server.request_timeout_s must be > 0 or null, got 0.0"),
        ("server.request_timeout_s=-1.5", "overrides: server.request_timeout_s must be > 0 or null, got -1.5"),
        ("mesh.model=0", "overrides: mesh.model must be >= 1, got 0"),
        ("server.api_server_count=0", "overrides: server.api_server_count must be >= 1, got 0"),
        (
            "model.dtype=fp32",
            "overrides: model.dtype must be one of auto, float32, bfloat16, float16, got 'fp32'",
        ),
        ("model.task=rerank", "overrides: model.task must be one of generate, embed, generate+embed, got 'rerank'"),
        ("model.pooling=max", "overrides: model.pooling must be one of auto, last, mean, cls, got 'max'"),
        (
            "engine.attention_backend=flash",
            "overrides: engine.attention_backend must be one of auto, reference, pallas, pallas_decode, "
            "pallas_ragged, got 'flash'",
        ),
        (
            "server.log_level=INFO",
            "overrides: server.log_level must be one of debug, info, warning, error, got 'INFO'",
        ),
        ("server.api_key=''", "overrides: server.api_key must not be empty (use null for the default)"),
        ("engine=1", "overrides: 'engine' is a section; override its keys as engine.<key>"),
        (
            "engine.page_size.x=1",
            "overrides: 'engine.page_size' is not a section, so 'engine.page_size.x' is not a key",
        ),
        ("engine.page_size", "overrides: invalid override 'engine.page_size'; expected section.field=value"),
    ],
)
def test_override_errors(override: str, message: str) -> None:
    assert error_of(load_config, REPO_DEFAULT, [override]) == message


def test_several_front_ends_need_the_core_process() -> None:
    overrides = ["server.api_server_count=2", "server.engine_process=false"]
    assert error_of(load_config, REPO_DEFAULT, overrides) == (
        "overrides: server.api_server_count > 1 needs server.engine_process: true "
        "(the front ends share one engine core)"
    )
    assert load_config(REPO_DEFAULT, ["server.api_server_count=2"]).server.api_server_count == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("engine:\n  page_size: 12\n", "{path}: engine.page_size must be a power of two >= 1, got 12"),
        (
            "server:\n  prot: 1\n",
            "{path}: unknown key 'server.prot' (did you mean 'server.port'?); "
            "known keys: host, port, served_model_name, api_key, log_level, drain_timeout_s, max_body_bytes, "
            "allowed_origins, allowed_methods, allowed_headers, allow_credentials, request_timeout_s, "
            "tool_call_parser, enable_auto_tool_choice, reasoning_parser, engine_process, "
            "api_server_count, responses_store_size, otlp_traces_endpoint, log_requests, max_logprobs, "
            "trust_request_chat_template, "
            "return_tokens_as_token_ids, "
            "ssl_keyfile, ssl_certfile, ssl_ca_certs",
        ),
        ("engine: [1, 2]\n", "{path}: engine: expected a mapping of keys, got [1, 2] (list)"),
        ("- model\n", "{path}: top level: expected a mapping of sections, got ['model'] (list)"),
        ("a: b: c\n", "{path}: invalid YAML: mapping values are not allowed here at line 1, column 5"),
        (
            "model:\n  dtype: [\n",
            "{path}: invalid YAML: expected the node content, but found '<stream end>' at line 3, column 1",
        ),
    ],
)
def test_file_errors_name_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    assert error_of(load_config, path) == message.format(path=path)


def test_unreadable_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert error_of(load_config, missing) == f"{missing}: cannot read config file: No such file or directory"
    assert error_of(load_config, tmp_path) == f"{tmp_path}: cannot read config file: Is a directory"


def test_config_from_dict_names_its_source() -> None:
    message = error_of(config_from_dict, {"mesh": {"data": -1}}, "cli")
    assert message == "cli: mesh.data must be >= 1, got -1"
    assert error_of(config_from_dict, ["x"], "cli").startswith("cli: top level: expected a mapping")


def test_config_error_is_a_myserve_error() -> None:
    assert issubclass(ConfigError, MyserveError)


def test_direct_construction_validates() -> None:
    with pytest.raises(ConfigError, match=re.escape("engine.page_size must be a power of two >= 1, got 0")):
        EngineConfig(page_size=0)


# --- generic coercion -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Knobs:
    ratio: float = 0.5
    """A float."""
    flag: bool = False
    """A bool."""
    sizes: tuple[int, ...] = (1, 2)
    """Variable-length ints."""
    pair: tuple[int, str] | None = None
    """Fixed-length pair, or null."""
    undocumented: int = 0


def test_generic_coercion_over_field_types() -> None:
    knobs = from_mapping(_Knobs, {"ratio": 2, "flag": True, "sizes": [4, 8.0], "pair": [1, "a"]}, "t")
    assert knobs == _Knobs(ratio=2.0, flag=True, sizes=(4, 8), pair=(1, "a"))
    assert isinstance(knobs.ratio, float) and isinstance(knobs.sizes, tuple)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"flag": 1}, "t: flag: expected bool, got 1 (int)"),
        ({"ratio": False}, "t: ratio: expected float, got False (bool)"),
        ({"sizes": [1, "x"]}, "t: sizes[1]: expected int, got 'x' (str)"),
        ({"sizes": 3}, "t: sizes: expected tuple[int, ...], got 3 (int)"),
        ({"pair": [1]}, "t: pair: expected tuple[int, str] or null, got [1] (list)"),
        ({"undocumented": 1.5}, "t: undocumented: expected int, got 1.5 (float)"),
    ],
)
def test_generic_coercion_errors(data: dict[str, object], message: str) -> None:
    assert error_of(from_mapping, _Knobs, data, "t") == message


# --- frozen-ness and docs -------------------------------------------------------------------


def test_configs_are_frozen_and_hashable() -> None:
    config = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.engine.page_size = 32  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mesh = MeshConfig()  # type: ignore[misc]
    # Hashable so a config (or a section of it) can be a static argument to jax.jit.
    assert hash(config) == hash(load_config())


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda cls: cls.__name__)
def test_every_field_has_a_docstring(cls: type) -> None:
    docs = field_docs(cls)
    assert list(docs) == [field.name for field in dataclasses.fields(cls)]
    assert all(doc.strip() for doc in docs.values())
    assert all("\n" not in doc for doc in docs.values())


def test_field_docs_reads_attribute_docstrings() -> None:
    docs = field_docs(_Knobs)
    assert docs["pair"] == "Fixed-length pair, or null."
    assert "undocumented" not in docs
    assert key_docs(Config)["engine.page_size"] == field_docs(EngineConfig)["page_size"]
    assert len(key_docs(Config)) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS[:5]) + 1  # + models
