"""MaxText's Llama parameter tree, as HF-named tensors in HF layout (``models/native_checkpoint.py``).

What MaxText saves for a Llama-family model (``decoder_block: llama2`` or ``mistral``): a training
run's Orbax ``CheckpointManager`` step (item ``items``, the ``TrainState``: its ``params`` are
``{"params": tree}``, beside ``opt_state`` and ``step``), and what its HF converters write
(``checkpoint_conversion/to_maxtext.py``, ``standalone_scripts/llama_or_mistral_ckpt.py``; the same
tree). Paths below are under that ``params.params``; projections are ``[in, out...]`` kernels:

- ``token_embedder.embedding`` ``[vocab, embed]`` (HF's ``embed_tokens``);
  ``decoder.decoder_norm.scale`` ``[embed]``; ``decoder.logits_dense.kernel`` ``[embed, vocab]``
  (``lm_head`` transposed; absent when ``logits_via_embedding`` ties it to the embedding).
- Per layer, under ``decoder.layers`` with every array's layers stacked on ``param_scan_axis``
  (``scan_layers``, the default: axis 1, so a norm is ``[embed, layers]``), or under
  ``decoder.layers_<i>`` one layer each: ``pre_self_attention_layer_norm.scale`` and
  ``post_self_attention_layer_norm.scale`` ``[embed]`` (HF's input and post-attention norms);
  ``self_attention.{query,key,value}.kernel`` ``[embed, heads, head_dim]`` (kv heads for key and
  value); ``self_attention.out.kernel`` ``[heads, head_dim, embed]``; ``mlp.wi_0``/``wi_1``
  ``[embed, mlp]`` (gate, up) and ``mlp.wo`` ``[mlp, embed]`` (down).

Two transforms besides the layouts, both undone here:

- The query kernel holds ``1/sqrt(head_dim)``: MaxText folds the score scale into it (its query
  initializer divides by it, its attention kernels use scale 1, its converters divide HF's ``q_proj``
  by it), so it is multiplied back (in float32, then the stored dtype: exact where ``head_dim`` is a
  power of 4, within one rounding of the stored dtype otherwise, e.g. 128 in bf16).
- RoPE layout: MaxText's ``RotaryEmbedding`` (Llama 2, Llama 3, Mistral) rotates halves like HF,
  but its ``LLaMARotaryEmbedding`` (``model_name: llama3.1-*`` or ``rope_type: llama3.1``, the only
  MaxText RoPE with Llama 3.1's frequency scaling) rotates interleaved pairs, and its converters
  interleave q and k per head for it (HF's ``[x_0..x_{d/2-1}, y_0..]`` becomes ``[x_0, y_0, x_1,
  ..]``). The checkpoint does not record which; the HF configuration does: Llama 3.1-style
  ``rope_scaling`` (``rope_type: llama3``) means interleaved, else halves as in HF. MaxText's
  current converter (``to_maxtext.py``, Llama 3.1 only) and the legacy one for Llama 3.1 agree;
  not Llama 3.3 (an HF configuration like 3.1's), which MaxText runs with ``RotaryEmbedding`` unless
  told ``rope_type: llama3.1`` and its legacy converter writes in halves from HF weights: such a
  checkpoint is read interleaved here, wrongly (there is no switch yet).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np

from myserve.errors import CheckpointError
from myserve.models.spec import ModelSpec, RopeScaling

MARKER = "token_embedder.embedding"
"""The array every MaxText decoder-only tree has, and no HF-keyed one."""

_TOP = {
    "model.embed_tokens.weight": "token_embedder.embedding",
    "model.norm.weight": "decoder.decoder_norm.scale",
    "lm_head.weight": "decoder.logits_dense.kernel",
}
_LAYER = {
    "input_layernorm.weight": "pre_self_attention_layer_norm.scale",
    "post_attention_layernorm.weight": "post_self_attention_layer_norm.scale",
    "self_attn.q_proj.weight": "self_attention.query.kernel",
    "self_attn.k_proj.weight": "self_attention.key.kernel",
    "self_attn.v_proj.weight": "self_attention.value.kernel",
    "self_attn.o_proj.weight": "self_attention.out.kernel",
    "mlp.gate_proj.weight": "mlp.wi_0.kernel",
    "mlp.up_proj.weight": "mlp.wi_1.kernel",
    "mlp.down_proj.weight": "mlp.wo.kernel",
}
MODEL_TYPES = ("llama", "mistral")
"""HF model types whose MaxText tree is this one (MaxText's ``llama2`` and ``mistral`` blocks)."""


def maxtext_prefix(stored: Collection[str]) -> str | None:
    """The key path of a MaxText tree's parameters among an Orbax pytree's array names (dotted):
    ``params.params.`` in a MaxText checkpoint, the shortest one that holds a tree (not the
    optimizer's moments, ``opt_state...params.``); None when the pytree is not MaxText's."""
    names = set(stored)
    prefixes = sorted((n[: -len(MARKER)] for n in names if n == MARKER or n.endswith("." + MARKER)), key=len)
    return next((p for p in prefixes if f"{p}decoder.decoder_norm.scale" in names), None)


class MaxTextTree:
    """Where each HF tensor is in a MaxText Llama tree, and how it goes back to HF's layout."""

    def __init__(
        self,
        where: Path,
        stored: Collection[str],
        prefix: str,
        spec: ModelSpec,
        shape_of: Callable[[str], tuple[int, ...]],
    ):
        """``where``: the checkpoint (for errors); ``stored``: its pytree's array names; ``prefix``:
        ``maxtext_prefix(stored)``; ``shape_of``: an array's shape by name (finds the scan axis)."""
        if spec.model_type not in MODEL_TYPES:
            raise CheckpointError(
                f"{where}: a MaxText parameter tree is read for {'/'.join(MODEL_TYPES)} models, not {spec.model_type}"
            )
        self.where = where
        self.spec = spec
        self.prefix = prefix
        self.arrays = sorted(n for n in stored if n.startswith(prefix))
        """The parameters' array names (the optimizer's state and the step left out)."""
        self.interleaved = isinstance(spec.rope_scaling, RopeScaling)
        """q and k in LLaMARotaryEmbedding's interleaved layout (see the module's docstring)."""
        norm = f"{prefix}decoder.layers.{_LAYER['input_layernorm.weight']}"
        self.scan_axis = self._scan_axis(norm, shape_of(norm)) if norm in self.arrays else None
        """The axis the layers are stacked on; None: one subtree per layer (``layers_<i>``)."""

    def _scan_axis(self, name: str, shape: tuple[int, ...]) -> int:
        e, layers = self.spec.hidden_size, self.spec.num_layers
        if shape == (e, layers):  # param_scan_axis 1, MaxText's default (also when e == layers)
            return 1
        if shape == (layers, e):
            return 0
        raise CheckpointError(
            f"{self.where}: {name} has shape {list(shape)}, not [{e}, {layers}] ([embed, layers]) as configured"
        )

    def locate(self, hf_name: str) -> tuple[str, tuple[Any, ...]] | None:
        """The array holding ``hf_name`` and the index of its layer in it (``()``: all of it)."""
        if hf_name in _TOP:
            name = self.prefix + _TOP[hf_name]
            return (name, ()) if name in self.arrays else None
        parts = hf_name.split(".", 3)
        if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() or parts[3] not in _LAYER:
            return None
        layer = int(parts[2])
        if layer >= self.spec.num_layers:
            return None
        if self.scan_axis is not None:
            name = f"{self.prefix}decoder.layers.{_LAYER[parts[3]]}"
            return (name, (slice(None),) * self.scan_axis + (layer,)) if name in self.arrays else None
        name = f"{self.prefix}decoder.layers_{layer}.{_LAYER[parts[3]]}"
        return (name, ()) if name in self.arrays else None

    def _expected(self, hf_name: str) -> tuple[int, ...]:
        """The MaxText shape (one layer's) of ``hf_name``."""
        s = self.spec
        e, v, d, m = s.hidden_size, s.vocab_size, s.head_dim, s.intermediate_size
        if hf_name.endswith("norm.weight"):
            return (e,)
        shapes = {
            "embed_tokens.weight": (v, e),
            "lm_head.weight": (e, v),
            "q_proj.weight": (e, s.num_heads, d),
            "k_proj.weight": (e, s.num_kv_heads, d),
            "v_proj.weight": (e, s.num_kv_heads, d),
            "o_proj.weight": (s.num_heads, d, e),
            "gate_proj.weight": (e, m),
            "up_proj.weight": (e, m),
            "down_proj.weight": (m, e),
        }
        return shapes[hf_name.rsplit(".", 2)[-2] + ".weight"]

    def to_hf(self, hf_name: str, array: np.ndarray) -> np.ndarray:
        """One layer's MaxText array of ``hf_name`` in HF's layout and values, in its stored dtype."""
        want = self._expected(hf_name)
        if array.shape != want:
            raise CheckpointError(
                f"{self.where}: {hf_name}'s MaxText array has shape {list(array.shape)}, not {list(want)} as configured"
            )
        if hf_name.endswith("q_proj.weight"):
            # Multiplied in float32 (MaxText divides in float32 too), as x * sqrt(d) in bf16 would
            # round twice.
            work = np.float64 if array.dtype == np.float64 else np.float32
            array = np.multiply(array, math.sqrt(self.spec.head_dim), dtype=work).astype(array.dtype)
        if self.interleaved and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            array = np.concatenate([array[..., 0::2], array[..., 1::2]], axis=-1)  # pairs -> halves
        if array.ndim == 1 or hf_name == "model.embed_tokens.weight":
            return array
        if hf_name.endswith("o_proj.weight"):
            return np.ascontiguousarray(array.reshape(-1, array.shape[-1]).T)
        return np.ascontiguousarray(array.reshape(array.shape[0], -1).T)
