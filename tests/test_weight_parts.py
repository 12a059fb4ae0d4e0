"""A multi-host load's reads of its own shards (``Placer.place``): every part of every sharded
weight, read from the parts of its HF tensors (``_splits``), equals that part of the whole weight.
Host logic: no device, no mesh."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from myserve.models.axes import ModelAxes
from myserve.models.loading import _VOCAB_SPLIT, SafetensorsSource, _layer_table, _moe_table, _splits
from myserve.models.placer import Placer


def halves(size: int) -> list[tuple[int, int]]:
    return [(0, size // 2), (size // 2, size)] if size > 1 else [(0, size)]


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_every_part_of_every_sharded_weight_is_that_part_of_the_whole(tiny_checkpoints: dict[str, Path], arch: str):
    source = SafetensorsSource(tiny_checkpoints[arch])
    spec = source.spec
    ax = ModelAxes.of(spec)
    placer = Placer(source, None, {}, np.dtype(np.float32))  # type: ignore[arg-type]
    table = {**_layer_table(spec, ax), **(_moe_table(spec, ax, False) if spec.is_moe else {})}
    weights = {f: (tuple(f"model.layers.1.{s}" for s in suffixes), axes, c) for f, (suffixes, axes, c) in table.items()}
    weights["embed"] = (("model.embed_tokens.weight",), (ax.Vocab, ax.Embed), None)
    if not spec.tie_word_embeddings:
        weights["lm_head"] = (("lm_head.weight",), (ax.Embed, ax.Vocab), np.transpose)
    splits = {**_splits(spec, fused=False), "embed": _VOCAB_SPLIT, "lm_head": _VOCAB_SPLIT}
    checked = 0
    for field, (names, axes, combine) in weights.items():
        split = splits.get(field)
        if split is None:
            continue
        whole = placer.host(names, axes, combine)
        read = placer.elements_read
        # every combination of halves along the axes the rules may shard (one or two of them)
        choices = [halves(a.size) if a.name in split else [(0, a.size)] for a in axes]
        for bounds in itertools.product(*choices):
            part = placer._read_part(names, axes, combine, split, bounds)
            assert np.array_equal(part, whole[tuple(slice(*b) for b in bounds)]), (field, bounds)
            checked += 1
        # the parts together read each element of the HF tensors once: no part reads another's
        assert placer.elements_read - read == whole.size, field
    assert checked >= 8
