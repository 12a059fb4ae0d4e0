"""The ``engine`` section of a deployment: the KV cache and scheduling. Its own module to keep
``schema.py`` readable; ``myserve.config`` re-exports it with the other sections."""

import dataclasses

from myserve.config.fields import check, check_choice, check_not_empty

ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas_decode", "pallas_ragged")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
"""``engine.kv_cache_dtype``'s choices (vLLM's names; ``fp8`` is ``fp8_e4m3``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """KV cache and scheduling."""

    page_size: int = 16
    """Tokens per KV cache page; a power of two."""
    num_pages: int | None = None
    """KV cache pages allocated at start (>= 2); memory = num_pages * page_size * per-token KV size;
    null = sized from memory (gpu_memory_utilization on GPU/TPU, kv_cache_memory_bytes)."""
    gpu_memory_utilization: float = 0.9
    """On GPU/TPU, with num_pages null: the fraction of each device's memory for weights, KV cache
    and activations together (the KV pool takes what the others leave), in (0, 1]."""
    kv_cache_memory_bytes: int | None = None
    """With num_pages null: the KV pool's bytes per device (over gpu_memory_utilization); null = on
    CPU, VLLM_CPU_KVCACHE_SPACE GiB if set, else 4 GiB or a quarter of the available memory,
    whichever is less (never more pages than max_num_seqs sequences of max_model_len can hold)."""
    attention_backend: str = "auto"
    """Paged attention implementation: auto, reference (pure JAX), pallas (the platform's kernel:
    the ragged kernel on TPU; on GPU our ragged kernel for prefill and decode rows, with sliding
    windows and soft caps, else JAX's paged decode kernel for decode rows), pallas_ragged or
    pallas_decode (those two GPU kernels by name); auto = pallas where the model fits it, else
    reference (CPU: reference)."""
    moe_backend: str = "auto"
    """Grouped matmul of a Mixture-of-Experts layer's experts: auto, loop (a loop over tiles of one
    expert's rows), ragged_dot (lax.ragged_dot) or pallas (GPU: our grouped matmul kernel, narrow
    experts read narrow); auto = ragged_dot on TPU, pallas on GPU, loop on CPU."""
    quantized_matmul: str = "auto"
    """How narrow (model.quantization int8 / int4) dense weights multiply: auto, xla (dequantized in
    the step, XLA fusing what it can) or pallas (GPU, one device per replica: our grouped matmul
    kernel reads the codes as stored); auto = xla."""
    kv_cache_dtype: str = "auto"
    """What the KV cache holds: auto (the model's dtype), int8, fp8 (= fp8_e4m3) or fp8_e5m2: a byte
    per value and a bf16 scale per token and KV head, so the same memory holds ~2x (bf16 models) to
    ~4x (float32) the tokens; every attention path reads it quantized (docs/design/ops.md,
    "Quantized KV cache"). The TPU kernel takes fp8 only (one scale per cache)."""
    compilation_cache_dir: str | None = "~/.cache/myserve/xla"
    """Directory for JAX's persistent compilation cache, so a restart skips most of warmup's
    compiling; null = no persistent cache."""
    max_num_seqs: int = 64
    """Most sequences running at once (the largest decode batch)."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step (decode tokens plus prefill chunk tokens); null = the
    platform's: 256 on CPU, 2048 on GPU and TPU."""
    max_waiting: int = 1024
    """Most requests waiting for admission; beyond it submissions are refused as overloaded."""
    token_buckets: tuple[int, ...] = ()
    """Padded token counts of a step compiled at warmup (one executable each, per sampler
    variant): a step of decode tokens and prefill chunks runs in the smallest that holds it; the
    largest is always max_num_batched_tokens; empty = powers of two up to it."""
    context_buckets: tuple[int, ...] = ()
    """Context lengths (tokens) the attention's loop is compiled for, per token bucket: a step runs
    the smallest that holds its longest context (the loop has a static length, so that no device
    waits for its host), the widest built before ready and the narrower ones in the background
    (a step runs in a wider one until then); empty = 512, then x4 up to max_model_len (which
    is always the last)."""
    decode_steps: int = 0
    """K: tokens a decode produces per executable call when a step is decodes only and nothing
    needs the host between tokens (no grammar): one executable (``decode_loop``) runs K model and
    sampler iterations on the device (EOS, stop ids, max_tokens and min_tokens applied there),
    built in the background after warmup; K = 1 still makes a decode-only step one call (forward,
    head and sampler fused). 0 = the platform's default (8: docs/performance.md)."""
    decode_call_budget_ms: float = 250.0
    """The longest a several-token decode call may be expected to run (K times the measured time of
    one token at that batch size): a request arriving meanwhile waits for the call before its
    prefill, so where one token of the batch is slow (a large model or batch on a small device)
    decodes go one token per call and time to first token stays short; 0 = no limit."""
    enable_prefix_caching: bool = True
    """Reuse KV pages of identical prompt prefixes across requests."""
    kv_offloading_size: float = 0.0
    """GiB of host memory for a second tier of the prefix cache (vLLM's --kv-offloading-size): pages
    the device pool evicts are copied there and brought back on a hit instead of being computed
    again, least recently used dropped when full (docs/design/core.md, "Host tier"); split evenly
    over data-parallel replicas; 0 = no host tier."""
    async_scheduling: bool = True
    """Overlap the host with the device: plan and dispatch step N+1 (its in-flight tokens fed on
    the device from step N) before reading step N's tokens; false = one step at a time."""
    seed: int | None = None
    """Seed of the random seeds given to requests that send none (the same requests in the same
    order then sample alike on every run); null = from the operating system."""
    enable_lora: bool = False
    """Serve LoRA adapters of the model (PEFT checkpoints): every layer holds max_loras slots of
    adapter stacks and a request names an adapter as its model (docs/design/models.md, "LoRA")."""
    max_loras: int = 1
    """Adapters resident on the device at once (slots); a request whose adapter finds no free slot waits."""
    max_lora_rank: int = 16
    """Largest adapter rank served (the stacks' width: memory and compute grow with it)."""
    max_cpu_loras: int | None = None
    """Adapters kept read on the host (least recently used dropped); null = max_loras."""
    lora_modules: tuple[str, ...] = ()
    """Adapters served from the start, as name=path (a PEFT directory)."""
    enable_sleep_mode: bool = False
    """Serve vLLM's POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping: free the device's
    KV cache and weights between bursts of work (level 1 keeps the weights in host memory, level 2
    reads them again on wake-up), as RL frameworks do between rollouts (docs/design/core.md, "Sleep mode")."""
    enable_weight_updates: bool = False
    """Take new versions of the weights while serving (sglang's POST /update_weights_from_disk,
    docs/design/core.md "Live weight updates"): they read files the server can reach, so opt-in."""
    speculative_method: str = "none"
    """Speculative decoding: none, ngram (drafts looked up in the sequence itself: prompt lookup), or
    draft_model (a smaller model with the same vocabulary, speculative_model, drafts each token)."""
    speculative_model: str | None = None
    """draft_model: the draft's checkpoint (a directory or a hub id, as model.checkpoint)."""
    num_speculative_tokens: int = 4
    """Draft tokens a speculating decode proposes and verifies in one step (speculative_method not none)."""
    prompt_lookup_max: int = 5
    """ngram: the longest n-gram at the sequence's end looked up."""
    prompt_lookup_min: int = 1
    """ngram: the shortest n-gram at the sequence's end looked up."""

    def __post_init__(self) -> None:
        # Power of two so that page/offset arithmetic is shifts and kernels tile evenly.
        page_ok = self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0
        check(page_ok, f"engine.page_size must be a power of two >= 1, got {self.page_size}")
        check(self.num_pages is None or self.num_pages >= 2, f"engine.num_pages must be >= 2, got {self.num_pages}")
        util = self.gpu_memory_utilization
        check(0 < util <= 1, f"engine.gpu_memory_utilization must be in (0, 1], got {util}")
        kv_bytes = self.kv_cache_memory_bytes
        check(kv_bytes is None or kv_bytes > 0, f"engine.kv_cache_memory_bytes must be > 0, got {kv_bytes}")
        check_choice("engine.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("engine.moe_backend", self.moe_backend, ("auto", "loop", "ragged_dot", "pallas"))
        check_choice("engine.quantized_matmul", self.quantized_matmul, ("auto", "xla", "pallas"))
        check_choice("engine.kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_not_empty("engine.compilation_cache_dir", self.compilation_cache_dir)
        check(self.max_num_seqs >= 1, f"engine.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        budget = self.max_num_batched_tokens
        check(
            budget is None or budget >= self.max_num_seqs,
            f"engine.max_num_batched_tokens ({budget}) must be >= engine.max_num_seqs ({self.max_num_seqs})",
        )
        check(self.max_waiting >= 1, f"engine.max_waiting must be >= 1, got {self.max_waiting}")
        check(0 <= self.decode_steps <= 64, f"engine.decode_steps must be in [0, 64], got {self.decode_steps}")
        offload = self.kv_offloading_size
        check(offload >= 0, f"engine.kv_offloading_size must be >= 0 GiB, got {offload}")
        check(
            not offload or self.enable_prefix_caching,
            "engine.kv_offloading_size is a tier of the prefix cache: it needs engine.enable_prefix_caching",
        )
        check(
            not offload or self.speculative_method != "draft_model",
            "engine.kv_offloading_size: a draft model's own KV pages are not offloaded; use speculative_method ngram",
        )
        budget_ms = self.decode_call_budget_ms
        check(budget_ms >= 0, f"engine.decode_call_budget_ms must be >= 0, got {budget_ms}")
        check(self.max_loras >= 1, f"engine.max_loras must be >= 1, got {self.max_loras}")
        check(1 <= self.max_lora_rank <= 512, f"engine.max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        cpu = self.max_cpu_loras
        check(cpu is None or cpu >= self.max_loras, f"engine.max_cpu_loras ({cpu}) must be >= max_loras")
        for module in self.lora_modules:
            check(
                "=" in module and all(module.split("=", 1)), f"engine.lora_modules: expected name=path, got {module!r}"
            )
        check(self.enable_lora or not self.lora_modules, "engine.lora_modules needs engine.enable_lora")
        check_choice("engine.speculative_method", self.speculative_method, ("none", "ngram", "draft_model"))
        check(
            (self.speculative_method == "draft_model") == (self.speculative_model is not None),
            "engine.speculative_model names the draft of engine.speculative_method=draft_model (and only then)",
        )
        k = self.num_speculative_tokens
        check(1 <= k <= 16, f"engine.num_speculative_tokens must be in [1, 16], got {k}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        check(1 <= lo <= hi, f"engine.prompt_lookup_min ({lo}) must be >= 1 and <= prompt_lookup_max ({hi})")
        buckets = list(self.token_buckets)
        check(
            all(b >= 1 for b in buckets) and buckets == sorted(set(buckets)),
            f"engine.token_buckets must be increasing positive integers, got {buckets}",
        )
        contexts = list(self.context_buckets)
        check(
            all(c >= 1 for c in contexts) and contexts == sorted(set(contexts)),
            f"engine.context_buckets must be increasing positive integers, got {contexts}",
        )
        check(
            not buckets or budget is None or buckets[-1] <= budget,
            f"engine.token_buckets must not exceed max_num_batched_tokens ({budget}), got {buckets}",
        )

    def token_budget(self, platform: str) -> int:
        """``max_num_batched_tokens``, or the platform's default when null (never below the
        largest token bucket nor max_num_seqs)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        default = 256 if platform == "cpu" else 2048
        return max(default, self.max_num_seqs, *self.token_buckets)
