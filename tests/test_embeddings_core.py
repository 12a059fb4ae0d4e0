"""Embedding requests in the engine core, on the fake device (no JAX, milliseconds): prefill-only
sequences in the same steps as generation, pooled across chunks, with the prefix cache where the
pooling allows it, and their pages released when their vector is out.

``FakeDevice`` pools the vector (1, token id, position, 0) of each pooled token, so every expected
embedding is known exactly."""

from __future__ import annotations

import numpy as np
import pytest

from myserve.testing.fake_core import FAKE_HIDDEN, FakeCore, assert_consistent
from myserve.wire.outputs import ContextLengthExceeded
from myserve.wire.params import InvalidParams, SamplingParams
from myserve.wire.pooling import Pooler, PoolingParams

PROMPT = list(range(10, 30))  # 20 tokens: several chunks of a 16-token budget, several 4-token pages


def embed(dimensions: int | None = None, normalize: bool | None = False) -> SamplingParams:
    return SamplingParams(pooling=PoolingParams(dimensions=dimensions, normalize=normalize))


def fake_vector(tokens: list[int], positions: list[int]) -> np.ndarray:
    return np.array([[1.0, t, p, 0.0] for t, p in zip(tokens, positions, strict=True)], np.float32)


def vector_of(core: FakeCore, request_id: str) -> np.ndarray:
    (out,) = [o for o in core.outputs if o.request_id == request_id and o.embedding is not None]
    assert out.finish_reason == "stop" and out.token_ids == ()
    return np.frombuffer(out.embedding, "<f4")


def pooler(kind: str, **kwargs: object) -> Pooler:
    return Pooler(kind, kwargs.pop("normalize", False), FAKE_HIDDEN, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_a_prompt_pools_over_its_chunks(kind: str, overlap: bool) -> None:
    core = FakeCore(budget=8, pooler=pooler(kind), overlap=overlap)
    core.submit(PROMPT, embed(), "e")
    core.run()
    every = fake_vector(PROMPT, list(range(len(PROMPT))))
    expected = {"last": every[-1], "mean": every.mean(axis=0), "cls": every[0]}[kind]
    np.testing.assert_allclose(vector_of(core, "e"), expected, rtol=1e-6)
    assert len(core.batches) >= 3  # 20 tokens in 8-token steps: it really was chunked
    (final,) = [o for o in core.outputs if o.final]
    assert final.usage is not None and (final.usage.prompt_tokens, final.usage.completion_tokens) == (20, 0)
    assert_consistent(core.scheduler, core.live)
    assert core.scheduler.allocator.num_used == 0  # no page kept once the vector is out


def test_embeddings_run_in_the_same_steps_as_generation_and_sample_nothing() -> None:
    core = FakeCore(budget=32, max_num_seqs=8, pooler=pooler("mean"), overlap=True)
    core.submit([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0), "g")
    core.step()
    core.submit(PROMPT, embed(), "e")
    batch = core.step()
    assert {c.seq.request_id for c in batch.prefills + batch.decodes} == {"g", "e"}
    core.run()
    assert len(core.finished("g")[0][0]) == 6
    np.testing.assert_allclose(vector_of(core, "e"), fake_vector(PROMPT, list(range(20))).mean(axis=0), rtol=1e-6)
    # The embedding's chunk took no sampling row: every step sampled only the generation.
    from myserve.runtime import sampling_rows as rows

    assert all(int(step.ints[:, rows.WEIGHT].sum()) <= 1 for step in core.device.steps)


def test_last_token_pooling_reuses_the_prefix_cache_and_mean_does_not() -> None:
    for kind, hit in (("last", True), ("mean", False)):
        core = FakeCore(budget=32, pooler=pooler(kind))
        core.submit(PROMPT, embed(), "a")
        core.run()
        core.submit(PROMPT, embed(), "b")
        core.run()
        (seq,) = [s for s in core.seqs if s.request_id == "b"]
        assert (seq.num_prefix_hit_tokens > 0) is hit
        np.testing.assert_array_equal(vector_of(core, "a"), vector_of(core, "b"))


def test_a_prompt_whose_pages_are_all_cached_still_computes_its_last_token() -> None:
    prompt = PROMPT[:17]  # 4 full pages of 4 and one token: the hit leaves exactly one token
    core = FakeCore(budget=32, pooler=pooler("last"))
    core.submit(prompt, embed(), "a")
    core.run()
    core.submit(prompt, embed(), "b")
    assert core.run() <= 3
    np.testing.assert_array_equal(vector_of(core, "b"), fake_vector(prompt[-1:], [16])[0])


def test_dimensions_truncate_then_normalize() -> None:
    core = FakeCore(pooler=pooler("last", normalize=True, dimensions=()))
    core.submit(PROMPT, embed(dimensions=3, normalize=None), "e")
    core.run()
    head = fake_vector(PROMPT[-1:], [19])[0][:3]
    np.testing.assert_allclose(vector_of(core, "e"), head / np.linalg.norm(head), rtol=1e-6)


def test_requests_a_model_cannot_serve_are_refused() -> None:
    plain = FakeCore()
    with pytest.raises(InvalidParams, match="does not serve embeddings"):
        plain.submit(PROMPT, embed())
    only = FakeCore(pooler=Pooler("last", True, FAKE_HIDDEN, generate=False))
    with pytest.raises(InvalidParams, match="embeddings only"):
        only.submit(PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidParams, match="matryoshka") as e:
        only.submit(PROMPT, embed(dimensions=2))
    assert e.value.param == "dimensions"
    some = FakeCore(pooler=pooler("last", dimensions=(2, 4)))
    with pytest.raises(InvalidParams, match="one of 2, 4"):
        some.submit(PROMPT, embed(dimensions=3))
    short = FakeCore(max_model_len=16, num_pages=8, pooler=pooler("last"))
    with pytest.raises(ContextLengthExceeded, match="truncate_prompt_tokens"):
        short.submit(PROMPT, embed())
    short.submit(PROMPT[:16], embed())  # exactly the context: no completion token is reserved
    short.run()


def test_an_aborted_embedding_releases_its_pages_and_sends_no_vector() -> None:
    core = FakeCore(budget=8, pooler=pooler("mean"), overlap=True)
    core.submit(PROMPT, embed(), "e")
    core.step()
    core.abort("e")
    core.run()
    assert not [o for o in core.outputs if o.embedding is not None]
    assert core.scheduler.allocator.num_used == 0
    assert_consistent(core.scheduler, core.live)


def test_a_preempted_embedding_is_recomputed_to_the_same_vector() -> None:
    # 8 pages of 4 tokens; each request needs 7: the generation's growth preempts the newer
    # embedding mid-prompt, which is recomputed from its start once the generation is done.
    prompt = list(range(10, 38))
    core = FakeCore(num_pages=8, page_size=4, budget=8, max_model_len=32, pooler=pooler("mean"))
    core.submit([1] * 12, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), "g")
    core.step()
    core.submit(prompt, embed(), "e")
    core.run()
    assert core.scheduler.num_preemptions > 0
    np.testing.assert_allclose(vector_of(core, "e"), fake_vector(prompt, list(range(28))).mean(axis=0), rtol=1e-6)


def _st_checkpoint(root, pooling: dict, *, normalize: bool, hf: dict | None = None):  # noqa: ANN001, ANN202
    """A directory with sentence-transformers' modules.json and pooling config (no weights needed)."""
    import json

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (root / "1_Pooling").mkdir(parents=True)
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    (root / "config.json").write_text(json.dumps(hf or {}))
    return root


def test_the_pooler_comes_from_sentence_transformers_files_unless_the_config_says(tmp_path) -> None:  # noqa: ANN001
    from myserve.config import ModelConfig
    from myserve.core.pooler import resolve_pooler
    from myserve.errors import ConfigError

    embed = ModelConfig(task="embed")
    mean = _st_checkpoint(tmp_path / "mean", {"pooling_mode_mean_tokens": True}, normalize=True)
    assert resolve_pooler(embed, mean, 64) == Pooler("mean", True, 64, None, generate=False)
    last = _st_checkpoint(
        tmp_path / "last", {"pooling_mode_lasttoken": True}, normalize=False, hf={"matryoshka_dimensions": [32, 64]}
    )
    assert resolve_pooler(embed, last, 64) == Pooler("last", False, 64, (32, 64), generate=False)
    cls = _st_checkpoint(tmp_path / "cls", {"pooling_mode_cls_token": True}, normalize=True, hf={"is_matryoshka": True})
    both = ModelConfig(task="generate+embed")
    assert resolve_pooler(both, cls, 64) == Pooler("cls", True, 64, (), generate=True)
    # What the config sets wins; no files (a GGUF, or a plain checkpoint): last, normalized.
    chosen = ModelConfig(task="embed", pooling="mean", normalize=False, matryoshka_dimensions=(16,))
    assert resolve_pooler(chosen, cls, 64) == Pooler("mean", False, 64, (16,), generate=False)
    assert resolve_pooler(embed, None, 64) == Pooler("last", True, 64, None, generate=False)
    assert resolve_pooler(ModelConfig(), cls, 64) is None  # task generate: no embeddings
    weighted = _st_checkpoint(tmp_path / "w", {"pooling_mode_weightedmean_tokens": True}, normalize=True)
    with pytest.raises(ConfigError, match="weightedmean_tokens is not served"):
        resolve_pooler(embed, weighted, 64)
    with pytest.raises(ConfigError, match="model.task must be one of"):
        ModelConfig(task="rerank")
