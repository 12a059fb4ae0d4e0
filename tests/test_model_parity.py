"""Full-sequence logits of every supported architecture, through the served step, match transformers in float32."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_on_mesh
from ragged_steps import chunked_logits

from myserve.models.spec import LinearRopeScaling
from myserve.runtime.kv_cache import init_kv_cache
from myserve.runtime.model_step import StepLogits
from myserve.testing import TINY_ARCHES, hf_logits


def full_logits(model, mesh, mapping, ids: list[int], page_size: int = 16) -> np.ndarray:
    """Our logits [T, vocab] for one step over the whole sequence (one contiguous page run)."""
    pages = -(-len(ids) // page_size)
    cache = init_kv_cache(model.spec, pages, page_size, jnp.float32, mesh, mapping)
    forward = StepLogits.of(model, mesh, mapping, page_size)
    logits, _ = chunked_logits(forward, cache, ids, list(range(pages)), [len(ids)])
    return logits


@pytest.mark.parametrize("arch", list(TINY_ARCHES))
def test_logits_match_transformers(arch: str, tiny_checkpoints) -> None:
    ids = [int(t) for t in np.random.RandomState(7).randint(0, 256, size=45)]
    model, mesh, mapping = load_on_mesh(tiny_checkpoints[arch])
    ours = full_logits(model, mesh, mapping, ids)
    ref = hf_logits(tiny_checkpoints[arch], ids)
    assert ours.shape == ref.shape
    # The weights are large enough that logits span several units: a 1e-4 bound is meaningful.
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_spec_flags_per_family(tiny_checkpoints) -> None:
    """Each tiny checkpoint really exercises its family's difference."""
    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.models.loading import open_source

    specs = {a: open_source(resolve_checkpoint(d)).spec for a, d in tiny_checkpoints.items()}
    assert specs["llama3"].rope_scaling is not None and specs["llama3"].rope_scaling.factor == 8.0
    assert specs["llama_tied"].tie_word_embeddings
    assert not specs["llama3"].tie_word_embeddings
    assert specs["qwen2"].qkv_bias and not specs["qwen2"].o_bias
    assert specs["qwen3"].qk_norm and specs["qwen3"].head_dim == 32
    assert specs["mistral"].model_type == "mistral"
    g2, g3, mw = specs["gemma2"], specs["gemma3"], specs["mistral_window"]
    assert g2.layer_types == ("sliding", "full") and g2.sliding_window == 16
    assert g2.attn_softcap == 3.0 and g2.final_softcap == 5.0 and g2.query_scale == 24**-0.5 != g2.head_dim**-0.5
    assert g2.hidden_act == "gelu_pytorch_tanh" and g2.embed_scale == 8.0 and g2.tie_word_embeddings
    assert g2.sandwich_norms and g2.norm_unit_offset and not g2.qk_norm
    assert g3.qk_norm and g3.attn_softcap is None and g3.final_softcap is None
    sliding, full = g3.layer_kinds()
    assert (sliding.window, sliding.rope_theta, sliding.rope_scaling) == (16, 1000.0, None)
    assert (full.window, full.rope_theta, full.rope_scaling) == (None, 100000.0, LinearRopeScaling(4.0))
    assert mw.layer_types == ("sliding", "sliding") and {k.window for k in mw.layer_kinds()} == {16}
    for arch in ("llama3", "llama_tied", "mistral", "qwen2", "qwen3"):  # Llama-family defaults
        s = specs[arch]
        assert s.layer_types == () and s.hidden_act == "silu" and s.embed_scale is None
        assert not (s.sandwich_norms or s.norm_unit_offset) and s.attn_softcap is None is s.final_softcap
        assert s.sm_scale == 1.0 / math.sqrt(s.head_dim)


@pytest.mark.parametrize(("arch", "traces"), [("mistral_window", 1), ("gemma2", 2)])
def test_one_layer_trace_per_kind(arch: str, traces: int, tiny_checkpoints, monkeypatch) -> None:
    """The step traces its layer function once per distinct layer kind, not once per layer: both
    of Mistral's layers slide (one kind), Gemma 2 alternates sliding and global layers (two)."""
    import dataclasses

    from myserve.models.llama import LlamaModel
    from myserve.runtime import model_step

    kinds: list = []
    real = model_step.decoder_block
    monkeypatch.setattr(model_step, "decoder_block", lambda *a: kinds.append(a[-1]) or real(*a))
    model, mesh, mapping = load_on_mesh(tiny_checkpoints[arch])
    # A spec no other test used, so that nothing is cached from before.
    spec = dataclasses.replace(model.spec, max_position_embeddings=777)
    fresh = LlamaModel(spec, model.attention_backend, model.embed, model.layers, model.final_norm, model.lm_head)
    full_logits(fresh, mesh, mapping, list(range(3, 48)))
    assert len(kinds) == traces == len(set(kinds)) and len(fresh.layers) == 2
