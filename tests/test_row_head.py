"""A tied table's one-row copy on CPU (models/row_head.py): made where it pays, read by one-row logits only."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_on_mesh

from myserve.models.checkpoint import resolve_checkpoint
from myserve.models.loading import load_model, open_source
from myserve.models.row_head import MAX_COPY_BYTES, wants_row_head
from myserve.models.sharding import axis_mapping
from myserve.runtime.mesh import make_mesh
from myserve.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("row-head")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in ("llama_tied", "llama3")}


def _logits(model, rows: np.ndarray) -> np.ndarray:  # noqa: ANN001
    hidden = hax.named(jnp.asarray(rows), ("batch", model.axes.Embed.name))
    return np.asarray(jax.jit(lambda m, h: m.logits(h).array)(model, hidden))


def test_a_tied_float32_model_on_cpu_holds_its_table_transposed(checkpoints: dict[str, Path]) -> None:
    model, _, _ = load_on_mesh(checkpoints["llama_tied"])
    assert model.lm_head is None and model.row_head is not None
    assert model.row_head.axes == (model.axes.Embed, model.axes.Vocab)
    np.testing.assert_array_equal(np.asarray(model.row_head.array), np.asarray(model.embed.array).T)

    untied, _, _ = load_on_mesh(checkpoints["llama3"])
    assert untied.lm_head is not None and untied.row_head is None

    source = open_source(resolve_checkpoint(checkpoints["llama_tied"]))
    mesh = make_mesh(1, 1)
    bf16 = load_model(source, mesh, axis_mapping(source.spec, mesh), dtype=jnp.dtype(jnp.bfloat16))
    assert bf16.row_head is None  # a bfloat16 row is two rows on CPU (dense_dot): the matrix-matrix kernel


def test_the_copy_is_for_cpus_and_tables_whose_copy_costs_little() -> None:
    mesh = make_mesh(1, 1)
    assert wants_row_head(mesh, jnp.dtype(jnp.float32), 49152, 64)
    assert not wants_row_head(mesh, jnp.dtype(jnp.bfloat16), 49152, 64)
    assert wants_row_head(mesh, jnp.dtype(jnp.float32), MAX_COPY_BYTES // 4 // 64, 64)
    assert not wants_row_head(mesh, jnp.dtype(jnp.float32), 128256, 2048)  # 1 GB: one table only


def test_one_row_logits_read_the_copy_and_several_rows_the_table(checkpoints: dict[str, Path]) -> None:
    model, _, _ = load_on_mesh(checkpoints["llama_tied"])
    table = np.asarray(model.embed.array, np.float64)
    rows = np.random.RandomState(0).randn(4, table.shape[1]).astype(np.float32)
    one, four = _logits(model, rows[:1]), _logits(model, rows)
    np.testing.assert_allclose(one[0], table @ rows[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(four, rows.astype(np.float64) @ table.T, rtol=0, atol=1e-5)
    assert int(one[0].argmax()) == int(four[0].argmax())

    # Which array each product reads: a poisoned copy shows in one row's logits only.
    poisoned = eqx.tree_at(lambda m: m.row_head, model, hax.full_like(model.row_head, jnp.nan))
    assert np.isnan(_logits(poisoned, rows[:1])).all()
    assert np.isfinite(_logits(poisoned, rows)).all()


def test_the_memory_estimate_counts_the_copy(checkpoints: dict[str, Path]) -> None:
    from myserve.config.schema import config_from_dict
    from myserve.runtime.footprint import spec_and_parameters, weight_bytes

    tied = config_from_dict({"model": {"checkpoint": str(checkpoints["llama_tied"]), "dtype": "float32"}}, "test")
    spec, parameters = spec_and_parameters(str(checkpoints["llama_tied"]))
    copy = spec.vocab_size * spec.hidden_size * 4
    assert weight_bytes(tied, "cpu") == parameters * 4 + copy
    assert weight_bytes(tied, "gpu") == parameters * 4
    untied = config_from_dict({"model": {"checkpoint": str(checkpoints["llama3"]), "dtype": "float32"}}, "test")
    assert weight_bytes(untied, "cpu") == spec_and_parameters(str(checkpoints["llama3"]))[1] * 4
