"""Shared fakes for tests: tiny random HF checkpoints of each supported architecture.

Built with transformers (and therefore torch), so only tests import this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")

TINY_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

# name -> (config class name, extra config). Each exercises one family's differences.
TINY_ARCHES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
}


# A tiny-model engine with small buckets, so warmup stays short on 2 cores (config overrides).
TINY_ENGINE: tuple[str, ...] = (
    "model.max_model_len=512",
    "engine.page_size=8",
    "engine.max_num_seqs=8",
    "engine.max_num_batched_tokens=64",
    "engine.token_buckets=[1,8,64]",
)


NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
"""A nested JSON schema whose documents are bounded (objects, arrays, enums, required fields,
bounded integers, a pattern): every constrained generation of it can finish."""


def make_tiny_checkpoint(
    arch: str, directory: Path, *, seed: int = 0, dtype: str = "float32", vocab_size: int | None = None
) -> Path:
    """Save a tiny random model of ``arch`` (a key of TINY_ARCHES) with transformers; return the dir.

    ``vocab_size`` overrides the tiny 256 (e.g. SmolLM2's 49152, so chat-templated prompts fit).
    """
    import torch
    import transformers

    cls_name, extra = TINY_ARCHES[arch]
    sizes = {} if vocab_size is None else {"vocab_size": vocab_size}
    config = getattr(transformers, cls_name)(**{**TINY_COMMON, **extra, **sizes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Random init uses std 0.02, which makes every logit ~0; larger weights make parity meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory)
    return directory


def hf_logits(directory: Path, token_ids: list[int]):
    """Full-sequence float32 logits [T, vocab] from transformers, as numpy."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].float().numpy()


def start_service(checkpoint: Path | None, *overrides: str, prebuild: bool = False):
    """A started GenerationService (float32, warmed up) for ``checkpoint`` (None = bundled SmolLM2).
    ``prebuild``: the deployment builds its steps before reading the weights, as ``serve`` does.

    Tiny random checkpoints carry no tokenizer, so they borrow the bundled SmolLM2 one (their
    token ids are all inside its vocabulary). ``overrides`` are config ``section.key=value`` strings.
    """
    from myserve.bundled import bundled_gguf_path
    from myserve.config import load_config
    from myserve.runtime.deployment import Deployment
    from myserve.service import GenerationService

    base = ["model.dtype=float32"]
    if checkpoint is not None:
        base += [f"model.checkpoint={checkpoint}", f"model.tokenizer={bundled_gguf_path()}"]
    config = load_config(None, [*base, *overrides])
    service = GenerationService.from_deployment(Deployment.load(config, prebuild=prebuild))
    service.start()
    return service


def start_client(checkpoint: Path | None, *overrides: str):
    """A started ``EngineClient`` (float32, warmed up): the engine core in a child process, as
    ``python -m myserve.serve`` runs it; arguments as ``start_service``."""
    from myserve.bundled import bundled_gguf_path
    from myserve.config import load_config
    from myserve.frontend.core_client import EngineClient
    from myserve.serve import front_tokenizer

    base = ["model.dtype=float32"]
    if checkpoint is not None:
        base += [f"model.checkpoint={checkpoint}", f"model.tokenizer={bundled_gguf_path()}"]
    config = load_config(None, [*base, *overrides])
    client = EngineClient(config, lambda: front_tokenizer(config))
    client.wait_loaded()
    client.start()
    return client


def streamed_and_not(one: Callable[[int, bool], Awaitable[_T]], n: int) -> tuple[list[_T], list[_T]]:
    """``one(seed, stream)`` for seeds 0..n-1, all at once without streaming, then all at once
    streaming: (non-streamed results, streamed results)."""

    async def both() -> tuple[list[_T], list[_T]]:
        full = await asyncio.gather(*(one(seed, False) for seed in range(n)))
        parts = await asyncio.gather(*(one(seed, True) for seed in range(n)))
        return list(full), list(parts)

    return asyncio.run(both())


def collect(stream: Any) -> tuple[list[int], str, str | None]:
    """Drain a single-choice request stream: (token ids, text, finish reason)."""
    tokens: list[int] = []
    text, finish = "", None
    for out in stream:
        tokens.extend(out.token_ids)
        text += out.text
        finish = out.finish_reason or finish
    return tokens, text, finish


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]) -> list[int]:
    """transformers greedy ``generate`` for one prompt alone; the new token ids (EOS included)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_ids),
            pad_token_id=eos_ids[0],
        )
    return out[0, len(prompt_ids) :].tolist()


class HostEngine:
    """The engine's host loop with no device: the scheduler plans, a made-up token stands for each
    sample, and sequences finish at their length, as ``GenerationService`` drives a real runner.

    For unit tests of the scheduler, the page allocator and the penalty slots in milliseconds.
    """

    def __init__(self, scheduler: Any, on_schedule: Any = None, overlap: bool = False):
        from myserve.core.sequence import Sequence

        self.scheduler = scheduler
        self.overlap = overlap
        """Overlapped steps, as the service runs them: a step's samples are read after the next
        step is scheduled and dispatched (one step in flight)."""
        self.inflight: list[Sequence] = []
        """Sequences whose token the step in flight samples."""
        self.on_schedule = on_schedule
        """Called with each ``ScheduledBatch`` before it 'runs' (e.g. to lay it out as the runner would)."""
        self.live: list[Sequence] = []
        """Sequences submitted and not yet finished or aborted."""
        self.done: list[Sequence] = []
        self._ids = 0

    def submit(self, prompt: list[int], params: Any, max_len: int | None = None) -> list[Any]:
        """Queue a request's ``params.n`` choices (later ones share the first's prompt pages)."""
        from myserve.core.sequence import Sequence

        self._ids += 1
        max_len = max_len or len(prompt) + (params.max_tokens or 16)
        seqs: list[Sequence] = []
        for choice in range(params.n):
            seq = Sequence(f"r{self._ids}", choice, prompt, params, max_len, parent=seqs[0] if seqs else None)
            seqs.append(seq)
            self.scheduler.add(seq)
        self.live.extend(seqs)
        return seqs

    @staticmethod
    def token(seq: Any, position: int) -> int:
        """The made-up token a sequence samples at ``position`` (deterministic, never EOS-like)."""
        return 3 + (seq.seed + 7 * position) % 200

    def has_work(self) -> bool:
        """Whether a sequence waits or runs, or a step is in flight."""
        return bool(self.scheduler.has_work() or self.inflight)

    def step(self) -> Any:
        """One engine step: schedule and 'dispatch' (after_step), then read the step in flight
        before it (overlap) or this one: append each sampled token, finish full sequences."""
        from myserve.core.sequence import SeqStatus

        batch = self.scheduler.schedule()
        if self.on_schedule is not None:
            self.on_schedule(batch)
        chunks = (*batch.decodes, *batch.prefills)
        sampling = [c.seq for c in chunks if c.samples and c.seq.status is SeqStatus.RUNNING]
        self.scheduler.after_step(batch)
        read, self.inflight = (self.inflight, sampling) if self.overlap else (sampling, [])
        for seq in read:
            seq.num_inflight -= 1
            if seq.finish_reason is not None:
                continue  # finished or aborted while its token was in flight: the token is dropped
            seq.output_ids.append(self.token(seq, seq.num_known))
            if seq.num_known >= seq.max_len:
                self.finish(seq, "length")
        return batch

    def finish(self, seq: Any, reason: str) -> None:
        """End a sequence (finished or aborted) through the scheduler's one release path."""
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.live.remove(seq)
        self.done.append(seq)

    def run(self, max_steps: int = 10_000) -> int:
        """Step until nothing is left; the number of steps taken."""
        for i in range(max_steps):
            if not self.has_work():
                return i
            self.step()
        raise AssertionError(f"work left after {max_steps} steps: {self.scheduler.running} {self.scheduler.waiting}")


def assert_consistent(scheduler: Any, live: list[Any]) -> None:
    """The host bookkeeping invariants, given the sequences not yet finished or aborted.

    No page is both free and referenced; each refcount equals the references live sequences hold;
    every page is free, evictable (cached, unreferenced) or referenced, exactly one of them; every
    penalty slot is free or owned by exactly one running sequence that knows it.
    """
    from myserve.core.sequence import SeqStatus

    alloc, slots = scheduler.allocator, scheduler.slots
    held = [0] * alloc.num_pages
    for seq in live:
        if seq.status is not SeqStatus.RUNNING:
            assert not seq.pages and seq.slot is None, f"{seq} holds resources while not running"
        for page in seq.pages:
            held[page] += 1
    free, evictable = set(alloc._free), set(alloc._evictable)  # white-box: the allocator's own lists
    assert len(free) == len(alloc._free), "a page is on the free list twice"
    assert not free & evictable, "a page is both free and evictable"
    for page in range(alloc.num_pages):
        refs = alloc.refcount(page)
        assert refs == held[page], f"page {page}: refcount {refs}, held by {held[page]} live sequences"
        assert (refs > 0) + (page in free) + (page in evictable) == 1, f"page {page} is in no state or several"
    owners = {seq.slot: seq for seq in live if seq.slot is not None}
    assert len(owners) == sum(seq.slot is not None for seq in live), "two sequences share a penalty slot"
    for slot in range(slots.num_slots):
        assert slots.owner(slot) is owners.get(slot), f"penalty slot {slot}: pool and sequences disagree"
    for seq in scheduler.running:
        assert seq in live and (seq.slot is not None) == seq.params.uses_penalties, f"{seq}: slot {seq.slot}"
    assert slots.num_free == slots.num_slots - len(owners)
