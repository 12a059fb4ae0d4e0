"""A deployment: the model, its tokenizer and the mesh it lives on, built from a ``Config``."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from myserve.config import Config, EngineConfig
from myserve.errors import ConfigError
from myserve.models.checkpoint import ResolvedCheckpoint, declared_dtype, resolve_checkpoint, vision_spec_of
from myserve.models.gguf import resolve_quantization
from myserve.models.llama import LlamaModel
from myserve.models.loading import SafetensorsSource, TensorSource, load_model, open_source
from myserve.models.quant import MIN_ROWS
from myserve.models.sharding import MeshAxes, axis_mapping
from myserve.models.spec import ModelSpec
from myserve.models.vision import Tower, read_tower
from myserve.models.vision_qwen import read_qwen_tower
from myserve.models.vision_spec import VisionSpec
from myserve.ops.attention import resolve_backend
from myserve.runtime.buckets import Buckets
from myserve.runtime.compile_counter import compile_counts
from myserve.runtime.cpu_dtype import cpu_auto_dtype
from myserve.runtime.draft_model import DraftModels, check_draft, load_drafts
from myserve.runtime.executor import Executor, Prebuilt
from myserve.runtime.mesh import make_mesh, replica_meshes
from myserve.runtime.step_cache import StepCache, check_trusted_directory
from myserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def resolve_dtype(name: str, checkpoint_dir: Path | None = None) -> jnp.dtype:
    """``auto`` on CPU: bfloat16 where the CPU computes bfloat16 dots natively and the checkpoint does
    not declare float32, else float32 (``runtime/cpu_dtype.py``); on TPU/GPU the checkpoint's own
    dtype (its config.json's ``dtype``), bfloat16 for a float32 one or when it says none (as vLLM)."""
    if name != "auto":
        return jnp.dtype(name)
    if jax.default_backend() == "cpu":
        return jnp.dtype(cpu_auto_dtype(declared_dtype(checkpoint_dir)))
    return jnp.dtype(jnp.float16 if declared_dtype(checkpoint_dir) == "float16" else jnp.bfloat16)


def enable_compilation_cache(directory: Path | None) -> None:
    """Turn on JAX's persistent compilation cache in ``directory`` (every executable, however fast
    to build); the caller has checked that it is trusted (``check_trusted_directory``)."""
    if directory is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclasses.dataclass(frozen=True)
class Deployment:
    """Everything loaded for serving one model, ready for a runner to allocate its KV cache."""

    config: Config
    spec: ModelSpec
    models: tuple[LlamaModel, ...]
    """The weights once per data-parallel replica, each on its row of the mesh (``replica_meshes``)."""
    tokenizer: Tokenizer
    mesh: Mesh
    mapping: Mapping[str, MeshAxes]
    dtype: jnp.dtype
    max_model_len: int
    prebuilt: tuple[Future[Prebuilt], ...] = ()
    """Per replica, the step executables being built from the model's shapes since before its
    weights were read (``load(prebuild=True)``); ``CompileSteps`` takes them."""
    prebuild_started: tuple[float, int, int] | None = None
    """(perf_counter, compiled, loaded executables so far) when the early build began."""
    checkpoint_dir: Path | None = None
    """The checkpoint's directory (its sentence-transformers files say how it embeds); None for a
    single-file checkpoint (GGUF)."""
    draft: DraftModels | None = None
    """The draft model of ``engine.speculative_method=draft_model`` (``runtime/draft_model.py``)."""
    vision: tuple[VisionSpec, Tower] | None = None
    """A vision-language checkpoint's tower and projector (host arrays); None for a text-only model."""

    @property
    def model(self) -> LlamaModel:
        """The first replica's weights (the only ones when ``mesh.data == 1``)."""
        return self.models[0]

    @property
    def meshes(self) -> list[Mesh]:
        """The (1, model) mesh of each data-parallel replica."""
        return replica_meshes(self.mesh)

    @staticmethod
    def load(config: Config, *, prebuild: bool = False) -> Deployment:
        """Resolve the checkpoint, build the mesh, load weights onto it, load the tokenizer.

        ``prebuild``: first start building every step executable from the model's shapes alone, on
        a background thread, so that compiling (or loading them from the persistent cache) overlaps
        reading the weights (a server's start-up; the engine's warmup then takes them)."""
        t0 = time.perf_counter()
        cache_dir = config.engine.compilation_cache_dir
        # With the step cache the steps need no other: and an executable JAX loaded from its own
        # cache cannot be stored in the step cache (XLA:CPU serializes a loaded one without its
        # code), so JAX's cache stays off unless the step cache cannot be used (multi-host).
        # Refused in one line naming the path and the fix, before any work, if another user could write it.
        trusted = None if cache_dir is None else check_trusted_directory(cache_dir)
        enable_compilation_cache(None if StepCache.for_process(cache_dir) is not None else trusted)
        # The mesh first: a mesh the visible devices cannot hold fails before anything is read.
        mesh = make_mesh(config.mesh.data, config.mesh.model, expert=config.mesh.expert)
        resolved = resolve_checkpoint(config.model.checkpoint)
        source = open_source(resolved, config.model.checkpoint_path)
        spec = source.spec
        check_expert_mesh(spec, config.mesh.expert)
        max_len = config.model.max_model_len or spec.max_position_embeddings
        mapping = axis_mapping(spec, mesh)
        dtype = resolve_dtype(config.model.dtype, resolved.path if resolved.path.is_dir() else None)
        platform = jax.default_backend()
        quantization = resolve_quantization(config.model.quantization, source, platform)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, quantization=quantization))
        config = _resolve_engine(config, spec, mesh, dtype, max_len)
        backend = resolve_backend(
            config.engine.attention_backend,  # type: ignore[arg-type]
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            page_size=config.engine.page_size,
            sliding_window="sliding" in spec.layer_types,
            soft_cap=spec.attn_softcap is not None,
            kv_cache_dtype=config.engine.kv_cache_dtype,
        )
        started = (time.perf_counter(), *compile_counts()) if prebuild else None
        prebuilt = _prebuild(config, source, mesh, mapping, dtype, backend, max_len) if prebuild else ()
        # The tokenizer loads on a thread meanwhile: its Python work overlaps the weights' numpy work
        # (most of which runs without the GIL), about half a second off a start on 2 cores.
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as loader:
            tokenizer_future = loader.submit(
                Tokenizer.load, config.model.tokenizer or resolved.path, chat_template=config.model.chat_template
            )
            # Each data-parallel replica reads its own copy onto its devices (per tensor, never whole).
            models = tuple(
                load_model(
                    source,
                    m,
                    mapping,
                    dtype,
                    backend,
                    quantization,
                    group_size=config.model.quantization_group_size,
                    lora=lora_stacks(config),
                    moe_backend=config.engine.moe_backend,
                    quantized_matmul=config.engine.quantized_matmul,
                )
                for m in replica_meshes(mesh)
            )
            tokenizer = tokenizer_future.result()
        draft = load_drafts(config, mesh, dtype, spec)
        vision = _load_vision(config, resolved, source, dtype, backend)
        logger.info(
            "loaded %s (%s, %d layers) as %s%s on mesh %s, attention=%s, in %.1fs",
            resolved.path,
            spec.model_type,
            spec.num_layers,
            dtype.name,
            "" if quantization == "none" else f" with {quantization} weights",
            dict(mesh.shape),
            backend,
            time.perf_counter() - t0,
        )
        directory = resolved.path if resolved.path.is_dir() else None
        return Deployment(
            config, spec, models, tokenizer, mesh, mapping, dtype, max_len, prebuilt, started, directory, draft, vision
        )


def _load_vision(
    config: Config, resolved: ResolvedCheckpoint, source: TensorSource, dtype: jnp.dtype, backend: str
) -> tuple[VisionSpec, Tower] | None:
    """The vision tower of a vision-language checkpoint (None for a text-only one), refused where
    images cannot be served yet: speculative decoding, several processes; and for images attending
    both ways (Gemma 3), the TPU kernel's cache layout (the reference attention masks them) and a
    token budget smaller than one image (a step computes an image's tokens together)."""
    if not resolved.path.is_dir():
        return None
    spec = vision_spec_of(resolved.path)
    if spec is None:
        return None
    if config.engine.speculative_method != "none":
        raise ConfigError("a vision-language model cannot speculate yet: leave engine.speculative_method none")
    if jax.process_count() > 1:
        raise ConfigError("a vision-language model is served by one process (mesh.num_processes 1)")
    if not isinstance(source, SafetensorsSource):
        raise ConfigError("a vision-language model's weights are read from its safetensors files")
    if spec.bidirectional:
        if backend == "pallas":
            raise ConfigError(f"{spec.family} images attend both ways, which the TPU attention kernel does not "
                              "mask: set engine.attention_backend reference")  # fmt: skip
        budget = config.engine.token_budget(jax.default_backend())
        if budget < spec.tokens_per_image:
            raise ConfigError(f"engine.max_num_batched_tokens ({budget}) must hold one image's "
                              f"{spec.tokens_per_image} tokens: a step computes an image whole")  # fmt: skip
    read = read_qwen_tower if spec.variable_size else read_tower
    return spec, read(source, spec, np.dtype(dtype))


def _resolve_engine(config: Config, spec: ModelSpec, mesh: Mesh, dtype: jnp.dtype, max_len: int) -> Config:
    """``config`` with the engine's platform defaults made concrete: the step budget, the decode
    steps per call, and the KV pool (sized from memory when ``num_pages`` is null, ``kv_sizing``).
    Raises ``ConfigError`` when the pool cannot hold one sequence of ``max_len`` tokens."""
    engine = config.engine
    platform = jax.default_backend()
    budget = engine.token_budget(platform)
    steps = engine.decode_steps or default_decode_steps(platform)
    pages = engine.num_pages
    if pages is None:
        from myserve.runtime.footprint import host_available, weight_bytes  # the several-model check's too
        from myserve.runtime.kv_sizing import plan_pages

        shards = mesh.shape.get("model", 1)
        draft_page, draft_weights = _draft_footprint(engine, spec, dtype, shards)
        stats = None if platform == "cpu" else (jax.local_devices()[0].memory_stats() or {})
        plan = plan_pages(
            engine,
            spec,
            platform=platform,
            itemsize=dtype.itemsize,
            max_model_len=max_len,
            token_budget=budget,
            model_shards=shards,
            weight_bytes=weight_bytes(config, platform) // (shards * mesh.shape.get("expert", 1)) + draft_weights,
            extra_page_bytes=draft_page,
            bytes_limit=None if stats is None else stats.get("bytes_limit"),
            host_available=host_available() if platform == "cpu" else None,
        )
        pages = plan.pages
        logger.info(
            "KV cache: %d pages of %d tokens (%.2f GiB per device) from %s",
            pages,
            engine.page_size,
            pages * plan.page_bytes / (1 << 30),
            plan.source,
        )
    elif pages * engine.page_size < max_len:
        # A sequence longer than the whole KV pool could never be scheduled: it would wait forever.
        raise ConfigError(
            f"engine.num_pages x engine.page_size ({pages * engine.page_size} tokens) is less than max_model_len "
            f"({max_len}): raise engine.num_pages to {-(-max_len // engine.page_size)} or lower model.max_model_len"
        )
    resolved = dataclasses.replace(engine, max_num_batched_tokens=budget, decode_steps=steps, num_pages=pages)
    return dataclasses.replace(config, engine=resolved)


def _draft_footprint(engine: EngineConfig, target: ModelSpec, dtype: jnp.dtype, shards: int) -> tuple[int, int]:
    """A draft model's bytes per KV page and weight bytes on one device (0, 0 without one), from
    its checkpoint's headers; refused early when it cannot draft for ``target``."""
    if engine.speculative_method != "draft_model":
        return 0, 0
    from myserve.runtime.footprint import spec_and_parameters
    from myserve.runtime.kv_sizing import page_bytes

    spec, parameters = spec_and_parameters(engine.speculative_model)
    check_draft(spec, target)
    return page_bytes(spec, engine.page_size, dtype.itemsize, shards), parameters * dtype.itemsize // shards


def default_decode_steps(platform: str) -> int:
    """``engine.decode_steps`` when the config leaves it 0: 8 on every platform. On a GPU the host
    spends 3-4 ms inside each executable call while a 1B model's token needs well under 1 ms of
    the device (an H200 trace, ``../shared/gpu/2026-11-28-h200/``), so a call must carry several
    tokens; on this CPU the host-bound yardstick went from 0.77x llama-server at one stream with
    K = 1 to 1.6-2.0x with K = 8, and the bundled model gives the same or more tokens/s
    (docs/performance.md, "Tokens per decode call")."""
    return 8


def check_expert_mesh(spec: ModelSpec, expert: int) -> None:
    """Refuse an ``expert`` mesh axis the model cannot use: a dense model, or experts that do not split evenly."""
    if expert == 1:
        return
    if not spec.is_moe:
        raise ConfigError(f"mesh.expert={expert} needs a Mixture-of-Experts model; {spec.model_type} is dense")
    if spec.num_experts % expert:
        raise ConfigError(f"mesh.expert={expert} must divide the model's {spec.num_experts} experts")


def executor_for(
    config: Config,
    model: LlamaModel,
    mesh: Mesh,
    mapping: Mapping[str, MeshAxes],
    prebuilt: Future[Prebuilt] | None = None,
    host_tier: bool = True,
) -> Executor:
    """One replica's executor of ``model`` (real or abstract) on ``mesh``, sized by the config;
    ``host_tier`` False: without the host tier's store (a draft model's executor)."""
    cfg = config.engine
    assert cfg.num_pages is not None, "Deployment.load sizes the KV pool (engine.num_pages null)"
    return Executor(
        model,
        mesh,
        mapping,
        num_pages=cfg.num_pages,
        page_size=cfg.page_size,
        num_slots=cfg.max_num_seqs + 1,
        prebuilt=prebuilt,
        step_cache=StepCache.for_process(cfg.compilation_cache_dir),
        sampler=config.model.task != "embed",
        pool=config.model.task != "generate",
        kv_cache_dtype=cfg.kv_cache_dtype,
        host_pages=host_pages(config, model) if host_tier else 0,
    )


def host_pages(config: Config, model: LlamaModel) -> int:
    """Pages of a replica's host tier of the prefix cache (``engine.kv_offloading_size``; 0: none)."""
    from myserve.runtime.kv_sizing import host_tier_pages

    itemsize = jnp.dtype(model.dtype).itemsize
    return host_tier_pages(config.engine, model.spec, itemsize, config.mesh.data)


def _prebuild(
    config: Config,
    source: TensorSource,
    mesh: Mesh,
    mapping: Mapping[str, MeshAxes],
    dtype: jnp.dtype,
    backend: str,
    max_len: int,
) -> tuple[Future[Prebuilt], ...]:
    """Start building each replica's step executables from abstract weights (nothing read)."""
    now, _ = step_buckets(config, max_len).compile_ops()
    pool = ThreadPoolExecutor(1, thread_name_prefix="prebuild")
    futures = []
    for replica_mesh in replica_meshes(mesh):
        model = load_model(
            source,
            replica_mesh,
            mapping,
            dtype,
            backend,
            config.model.quantization,
            abstract=True,
            group_size=config.model.quantization_group_size,
            lora=lora_stacks(config),
            moe_backend=config.engine.moe_backend,
            quantized_matmul=config.engine.quantized_matmul,
        )
        futures.append(pool.submit(executor_for(config, model, replica_mesh, mapping).build_all, now))
    pool.shutdown(wait=False)  # the thread ends when its builds are done
    return tuple(futures)


def step_buckets(config: Config, max_model_len: int) -> Buckets:
    """A deployment's step shapes (``Buckets.from_config``); w8a8 steps are at least MIN_ROWS tokens."""
    min_tokens = MIN_ROWS if config.model.quantization == "w8a8" else 1
    return Buckets.from_config(config.engine, max_model_len, min_tokens, jax.default_backend())


def lora_stacks(config: Config) -> tuple[int, int]:
    """(slots, max rank) of the LoRA stacks the model's layers hold, or (0, 0) without adapters."""
    engine = config.engine
    return (engine.max_loras, engine.max_lora_rank) if engine.enable_lora else (0, 0)
