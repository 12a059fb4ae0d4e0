"""Deployment configuration: nested frozen dataclasses, loaded from YAML and dotted-key overrides.

A deployment is a YAML file with one mapping per section (``model``, ``engine``, ``server``,
``mesh``); the command line overrides single keys as ``section.field=value``. Every field carries a
docstring right under it, which ``fields.field_docs`` reads back for ``--help``. How a
section is built from YAML values (types, unknown keys, dotted overrides) is ``fields.py``. Every mistake a user
can make here raises :class:`~myserve.errors.ConfigError` with one line naming the file (or
``overrides``) and the dotted key.
"""

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from myserve.config.engine import EngineConfig
from myserve.config.fields import (
    build,
    check,
    check_choice,
    check_names,
    check_not_empty,
    errors_from,
    inherit,
    parse_overrides,
    set_dotted,
    wrong_type,
)
from myserve.config.ray import RayConfig
from myserve.config.server import REASONING_PARSERS, TOOL_CALL_PARSERS, ServerConfig
from myserve.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w8a8")
DEFAULT_IMAGES_PER_PROMPT = 4
"""Images per prompt when ``model.limit_mm_per_prompt`` says nothing."""
TASKS, POOLINGS = ("generate", "embed", "generate+embed"), ("auto", "last", "mean", "cls")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to serve and how to run it."""

    checkpoint: str | None = None
    """HF checkpoint directory, hub id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct) or .gguf file path;
    null = the bundled SmolLM2-135M-Instruct GGUF."""
    tokenizer: str | None = None
    """Tokenizer source (directory, hub id or .gguf file); null = same as checkpoint."""
    checkpoint_path: str | None = None
    """An Orbax or Levanter checkpoint directory whose weights are served (docs/design/models.md,
    "Checkpoints from JAX trainers"); its config.json and tokenizer come from checkpoint, which
    defaults to hf_config, else to this directory."""
    hf_config: str | None = None
    """The directory (or hub id) of checkpoint_path's HF config.json: checkpoint's default."""
    chat_template: str | None = None
    """Path to a Jinja chat template file, or the template text itself; null = the tokenizer's own."""
    dtype: str = "auto"
    """Compute and weight dtype: auto, float32, bfloat16 or float16; auto = on CPU bfloat16 where the
    CPU computes it natively (AVX512-BF16) and the checkpoint does not declare float32, else float32;
    on TPU/GPU the checkpoint's bfloat16 or float16, else bfloat16."""
    max_model_len: int | None = None
    """Longest sequence (prompt + completion) in tokens, >= 1; null = the model's max_position_embeddings."""
    quantization: str = "auto"
    """Weights kept narrow on device (weight-only, dequantized inside each matmul): int8 (symmetric)
    or int4 (with offsets), in groups of quantization_group_size, for every matmul, the LM head and the embedding
    table, a GGUF file's Q8_0 / Q6_K blocks as int8 and Q4_0 / Q4_1 / Q4_K as int4 as stored; w8a8:
    int8 weights and per-token int8 activations on the dense matmuls; none: the model dtype. auto =
    none on CPU (fastest there, docs/performance.md), and on TPU/GPU a GGUF file's blocks as stored."""
    quantization_group_size: int = 128
    """Elements per scale of int8/int4 weights quantized at load (an even number; GGUF blocks keep
    their own), or 0: one scale per output channel."""
    task: str = "generate"
    """generate (chat, completions, responses), embed (/v1/embeddings only: no LM head nor sampler in
    its steps) or generate+embed (both, in the same steps)."""
    pooling: str = "auto"
    """Embeddings from the final hidden states: last (token), mean or cls (first token); auto = the
    checkpoint's sentence-transformers pooling (1_Pooling/config.json), else last."""
    normalize: bool | None = None
    """Unit-normalize embeddings; null = true unless sentence-transformers modules lack Normalize."""
    matryoshka_dimensions: tuple[int, ...] = ()
    """Widths a request's ``dimensions`` may truncate to; empty = per config.json (matryoshka_dimensions,
    is_matryoshka: any), else none."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub-id checkpoint; null = main."""
    download_dir: str | None = None
    """Where hub checkpoints are looked up and downloaded to; null = the Hugging Face cache (HF_HOME)."""
    generation_config: str = "auto"
    """Request defaults for the sampling fields a request leaves out: auto = the checkpoint's
    generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens),
    vllm = none (OpenAI's defaults), or a directory holding a generation_config.json."""
    override_generation_config: str | None = None
    """A JSON object of request defaults applied over generation_config's, e.g. '{"temperature": 0.5}'."""
    limit_mm_per_prompt: str | None = None
    """Inputs per prompt by modality, a JSON object (vLLM's), e.g. '{"image": 2}'; null = 4 images
    for a vision-language model (a text-only model takes none)."""
    allowed_media_domains: tuple[str, ...] = ()
    """Hosts whose http(s) image URLs the server fetches (exact names); empty = none: only data: URLs."""
    allowed_local_media_path: str | None = None
    """A directory whose files requests may name as file:// image URLs; null = none."""

    def __post_init__(self) -> None:
        for name in ("checkpoint", "tokenizer", "chat_template", "checkpoint_path", "hf_config"):
            check_not_empty(f"model.{name}", getattr(self, name))
        check(self.hf_config is None or self.checkpoint_path is not None, "model.hf_config needs model.checkpoint_path")
        check(
            self.hf_config is None or self.checkpoint in (None, self.hf_config),
            "model.hf_config and model.checkpoint name two configurations: give one",
        )
        if self.checkpoint_path is not None and self.checkpoint is None:  # the config.json beside the weights
            object.__setattr__(self, "checkpoint", self.hf_config or self.checkpoint_path)
        check_choice("model.dtype", self.dtype, DTYPES)
        check_choice("model.quantization", self.quantization, QUANTIZATIONS)
        group = self.quantization_group_size
        check(
            group is None or (group >= 2 and group % 2 == 0),
            f"model.quantization_group_size {group}: need an even number >= 2",
        )
        check_choice("model.task", self.task, TASKS)
        check_choice("model.pooling", self.pooling, POOLINGS)
        if self.max_model_len is not None:
            check(self.max_model_len >= 1, f"model.max_model_len must be >= 1, got {self.max_model_len}")
        for name in ("revision", "download_dir", "generation_config"):
            check_not_empty(f"model.{name}", getattr(self, name))
        if self.override_generation_config is not None:
            check_generation_overrides(self.override_generation_config)
        self.images_per_prompt  # noqa: B018 - parsed here, so a bad value fails at load
        check_not_empty("model.allowed_local_media_path", self.allowed_local_media_path)

    @property
    def images_per_prompt(self) -> int:
        """Images one prompt may carry (``limit_mm_per_prompt``'s ``image``, 4 when it names none)."""
        if self.limit_mm_per_prompt is None:
            return DEFAULT_IMAGES_PER_PROMPT
        try:
            value = json.loads(self.limit_mm_per_prompt)
        except json.JSONDecodeError as e:
            raise ConfigError(f"model.limit_mm_per_prompt: not JSON ({e.msg})") from None
        check(isinstance(value, dict), f"model.limit_mm_per_prompt must be a JSON object, got {value!r}")
        unknown = set(value) - {"image"}
        check(not unknown, f"model.limit_mm_per_prompt: only images are taken, not {', '.join(sorted(unknown))}")
        count = value.get("image", DEFAULT_IMAGES_PER_PROMPT)
        if isinstance(count, dict):  # vLLM's newer form: {"image": {"count": N, ...}}
            count = count.get("count", DEFAULT_IMAGES_PER_PROMPT)
        ok = isinstance(count, int) and not isinstance(count, bool) and count >= 0
        check(ok, f"model.limit_mm_per_prompt: image must be an integer >= 0, got {count!r}")
        return int(count)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh shape; data * expert * model devices are used."""

    data: int = 1
    """Size of the 'data' mesh axis (batch is sharded over it), >= 1."""
    model: int = 1
    """Size of the 'model' mesh axis (weights and KV heads are sharded over it), >= 1."""
    expert: int = 1
    """Size of the 'expert' mesh axis: a MoE model's experts are sharded over it (expert
    parallelism; attention is replicated across it), >= 1; must divide the number of experts."""
    num_processes: int | None = 1
    """Processes (hosts) serving together; 1 = this one; null = detected by jax.distributed
    (TPU pod slices, SLURM). Also MYSERVE_NUM_PROCESSES."""
    coordinator_address: str | None = None
    """host:port of process 0's coordination service, for num_processes > 1 (also MYSERVE_COORDINATOR_ADDRESS)."""
    process_id: int | None = None
    """This process's index, 0 = the leader that serves HTTP (also MYSERVE_PROCESS_ID)."""
    heartbeat_timeout_s: int = 30
    """Seconds without the leader's heartbeat after which the other processes stop (multi-host)."""
    step_channel_host: str | None = None
    """The leader's own address (IP or host name) on which it publishes each step to the followers,
    the only interface that socket binds; null = the coordinator address's host (multi-host)."""

    def __post_init__(self) -> None:
        check(self.data >= 1, f"mesh.data must be >= 1, got {self.data}")
        check(self.model >= 1, f"mesh.model must be >= 1, got {self.model}")
        check(self.expert >= 1, f"mesh.expert must be >= 1, got {self.expert}")
        n = self.num_processes
        check(n is None or n >= 1, f"mesh.num_processes must be >= 1 or null, got {n}")
        check_not_empty("mesh.coordinator_address", self.coordinator_address)
        pid = self.process_id
        check(pid is None or pid >= 0, f"mesh.process_id must be >= 0, got {pid}")
        if n is not None and pid is not None:
            check(pid < n, f"mesh.process_id ({pid}) must be < mesh.num_processes ({n})")
        check(self.heartbeat_timeout_s >= 1, f"mesh.heartbeat_timeout_s must be >= 1, got {self.heartbeat_timeout_s}")
        check_not_empty("mesh.step_channel_host", self.step_channel_host)

    def from_env(self, key: str) -> Any:
        """``key``'s value, from its ``MYSERVE_*`` environment variable (``MESH_ENV``) when set."""
        return os.environ.get(MESH_ENV[key], getattr(self, key))

    def role(self) -> str:
        """What this process is, known before JAX starts: ``single`` (one process), ``leader``
        (process 0), ``follower``, or ``unknown`` when JAX detects the id (no ``process_id``)."""
        num = self.from_env("num_processes")
        if num is not None and int(num) == 1:
            return "single"
        pid = self.from_env("process_id")
        if pid is None:
            return "unknown"
        return "leader" if int(pid) == 0 else "follower"


def too_few_devices(data: int, expert: int, model: int, have: int, platform: str) -> str:
    """The one-line refusal of a mesh that needs more devices than the ``have`` visible."""
    shape = f"data={data} x expert={expert} x model={model}" if expert > 1 else f"data={data} x model={model}"
    return f"mesh {shape} needs {data * expert * model} devices, but {have} {platform} device(s) are visible"


MESH_ENV = {
    "coordinator_address": "MYSERVE_COORDINATOR_ADDRESS",
    "num_processes": "MYSERVE_NUM_PROCESSES",
    "process_id": "MYSERVE_PROCESS_ID",
}
"""Environment variables that override these mesh keys (as cluster launchers set them)."""


MODEL_SECTIONS = ("model", "engine", "mesh")
"""The sections each entry of ``models`` has of its own (``server`` is the server's)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelEntry:
    """One model of a server that serves several (an entry of ``models``): its own engine core
    process, KV pool and warmup. In YAML its sections hold only what differs from the top-level
    ones, which every entry inherits key by key."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Which model to serve and how to run it."""
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    """Its KV cache and scheduling."""
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    """Its device mesh shape."""
    served_model_name: str | tuple[str, ...] | None = None
    """Its name in requests and /v1/models, or a list of names (aliases); null = derived from the checkpoint."""
    tool_call_parser: str | None = None
    """Its tool-call parser; null = server.tool_call_parser."""
    enable_auto_tool_choice: bool | None = None
    """Serve tool_choice auto for it; null = server.enable_auto_tool_choice."""
    reasoning_parser: str | None = None
    """Its reasoning parser; null = server.reasoning_parser."""

    def __post_init__(self) -> None:
        check_names("served_model_name", self.served_model_name)
        if self.tool_call_parser is not None:
            check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.reasoning_parser is not None:
            check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A whole deployment: one section per concern."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Which model to serve and how to run it."""
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    """KV cache and scheduling."""
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    """The HTTP front end."""
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    """Device mesh shape."""
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    """Engine replicas on Ray Serve (none by default)."""
    models: tuple[ModelEntry, ...] = ()
    """Several models in one server, each with its own engine core: the entries' model, engine and
    mesh sections override the top-level ones key by key; empty = the one model above."""

    def __post_init__(self) -> None:
        if self.ray.enabled:  # each replica is one engine of one host (ray/replica.py)
            check(not self.models, "ray (replicas on Ray Serve) serves one model: models must be empty")
            check(self.mesh.num_processes == 1, "ray: a replica's mesh is one host (mesh.num_processes: 1)")
            check(self.server.api_server_count == 1, "ray: Ray Serve's proxy is the front door (api_server_count: 1)")
            check(self.server.ssl_certfile is None, "ray: TLS ends at Ray Serve's proxy or a load balancer, not ssl_*")
        if not self.models:
            return
        # Each model's core is a process of this host, which the front end starts and supervises.
        check(self.server.engine_process, "models (several models) needs server.engine_process: true")
        check(self.server.api_server_count == 1, "models (several models) needs server.api_server_count: 1")
        check(self.server.served_model_name is None, "with models, set each entry's served_model_name instead")
        hosts = {e.mesh.num_processes for e in self.models}
        check(hosts == {1}, f"models: every entry's mesh.num_processes must be 1 (one host), got {hosts}")
        self.per_model()  # each model's server options (parsers) validated as that model's

    def per_model(self) -> tuple["Config", ...]:
        """One one-model config per served model (what its core and its front-end half are built
        from): this config itself without ``models``, else one per entry."""
        if not self.models:
            return (self,)
        return tuple(
            Config(
                model=e.model,
                engine=e.engine,
                mesh=e.mesh,
                server=dataclasses.replace(
                    self.server,
                    served_model_name=e.served_model_name,
                    tool_call_parser=e.tool_call_parser or self.server.tool_call_parser,
                    enable_auto_tool_choice=self.server.enable_auto_tool_choice
                    if e.enable_auto_tool_choice is None
                    else e.enable_auto_tool_choice,
                    reasoning_parser=e.reasoning_parser or self.server.reasoning_parser,
                ),
            )
            for e in self.models
        )


REMOVED_KEYS = {
    "engine.batch_buckets": "removed: a step is one ragged batch of tokens; set engine.token_buckets instead",
    "engine.prefill_row_tokens": "removed: prefill chunks join decodes in one step; set engine.token_buckets",
    "engine.page_buckets": "removed: set engine.context_buckets (context lengths the attention is compiled for)",
    "engine.layers_per_call": "removed: every layer runs in the one step executable; nothing replaces it",
}
"""Keys of earlier versions: each gets a one-line error naming what replaced it."""


def from_mapping[T](cls: type[T], data: Mapping[str, object], source: str) -> T:
    """Build any config dataclass ``cls`` from a parsed YAML mapping; ``source`` names it in errors."""
    with errors_from(source):
        if not isinstance(data, Mapping):
            raise wrong_type("top level", "a mapping of sections", data)
        return build(cls, data, "", REMOVED_KEYS)


def config_from_dict(d: Mapping[str, object], source: str) -> Config:
    """Build a :class:`Config` from a mapping of sections; missing keys take the dataclass defaults.
    Each entry of ``models`` inherits the top-level model, engine and mesh keys it does not set."""
    entries = d.get("models") if isinstance(d, Mapping) else None
    if isinstance(entries, list):
        d = {**d, "models": [inherit(d, entry, MODEL_SECTIONS) for entry in entries]}
    return from_mapping(Config, d, source)


def with_overrides(config: Config, overrides: Mapping[str, object], *, source: str = "overrides") -> Config:
    """Return ``config`` with dotted keys (``{"engine.page_size": 32}``) replaced, fully re-validated.
    A model, engine or mesh key is set for every entry of ``models`` too."""
    data = dataclasses.asdict(config)
    with errors_from(source):
        for key, value in overrides.items():
            set_dotted(data, Config, key, value, REMOVED_KEYS)
            if key.split(".")[0] in MODEL_SECTIONS:
                for entry in data["models"]:
                    set_dotted(entry, ModelEntry, key, value, REMOVED_KEYS)
        return build(Config, data, "", REMOVED_KEYS)


DEFAULT_CONFIG_NAME = "smollm2-135m-cpu.yaml"

# The same deployment as config/smollm2-135m-cpu.yaml, written as its differences from the dataclass
# defaults (a test keeps the two equal). The YAML file lives at the repository root, so a wheel
# (non-editable) install does not contain it; rather than make the default depend on package data
# and install layout, it is also kept here as data and used whenever the file is not beside the
# source tree. In a checkout the file wins, so editing it changes the default as a user expects.
_BUILTIN_DEFAULT: dict[str, dict[str, object]] = {
    "model": {"max_model_len": 2048},
    "engine": {
        "num_pages": 2048,
        "max_num_batched_tokens": 256,
        "token_buckets": [1, 4, 8, 16, 32, 64, 128, 256],
        "context_buckets": [128, 512, 2048],
    },
    "server": {"served_model_name": "SmolLM2-135M-Instruct"},
}


def default_config_path() -> Path | None:
    """The repository's ``config/smollm2-135m-cpu.yaml`` if this is a source checkout, else None."""
    path = Path(__file__).resolve().parents[3] / "config" / DEFAULT_CONFIG_NAME
    return path if path.is_file() else None


def _one_line(err: yaml.YAMLError) -> str:
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        return f"{err.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(err).split())


def _load_file(path: Path) -> Config:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ConfigError(f"{path}: cannot read config file: {reason}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {_one_line(err)}") from None
    # An empty (or all-comment) file means "all defaults", not an error.
    return config_from_dict({} if data is None else data, str(path))


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a deployment YAML (``None`` = the default CPU deployment), then apply ``overrides``.

    The file is validated on its own first, so an error names the file or ``overrides``, whichever
    holds the bad value.
    """
    if path is not None:
        config = _load_file(Path(path))
    elif (found := default_config_path()) is not None:
        config = _load_file(found)
    else:
        config = config_from_dict(_BUILTIN_DEFAULT, f"<built-in {DEFAULT_CONFIG_NAME}>")
    parsed = parse_overrides(overrides)
    return with_overrides(config, parsed) if parsed else config


GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
"""The fields of a generation config that become request defaults (as vLLM takes them)."""


def check_generation_overrides(text: str) -> dict[str, float]:
    """``model.override_generation_config``: a JSON object of ``GENERATION_DEFAULTS`` fields to numbers."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.override_generation_config: not JSON ({e.msg})") from None
    check(isinstance(value, dict), f"model.override_generation_config must be a JSON object, got {text!r}")
    for key, v in value.items():
        check(
            key in GENERATION_DEFAULTS,
            f"model.override_generation_config: unknown field {key!r}; known: {', '.join(GENERATION_DEFAULTS)}",
        )
        check(
            isinstance(v, int | float) and not isinstance(v, bool),
            f"model.override_generation_config: {key} must be a number, got {v!r}",
        )
    return value
