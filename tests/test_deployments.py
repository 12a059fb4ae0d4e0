"""The accelerator deployment YAMLs in config/: they validate, fit their chips, and a mesh the
visible devices cannot hold fails with one line (no weights are needed for any of this)."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from myserve.config import load_config
from myserve.entrypoints import serve
from myserve.errors import ConfigError
from myserve.ops.gpu_attention import gpu_fit
from myserve.ops.tpu_attention import pallas_fit
from myserve.runtime.deployment import Deployment

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"
GIB = 1 << 30

# file -> (layers, KV heads, head dim, parameters, of which routed experts', HBM bytes per device,
# devices) of the target.
DEPLOYMENTS = {
    "llama-3.1-8b-tpu-v5e-8.yaml": (32, 8, 128, 8.03e9, 0, 16 * GIB, 8),
    "llama-3.1-8b-h100.yaml": (32, 8, 128, 8.03e9, 0, 80 * 10**9, 1),
    "qwen3-32b-tpu-v6e-8.yaml": (64, 8, 128, 32.8e9, 0, 32 * GIB, 8),
    "qwen3-30b-a3b-tpu-v6e-8.yaml": (48, 4, 128, 30.5e9, 48 * 128 * 3 * 2048 * 768, 32 * GIB, 8),
}
HEADS = {"llama-3.1-8b-tpu-v5e-8.yaml": 32, "llama-3.1-8b-h100.yaml": 32, "qwen3-32b-tpu-v6e-8.yaml": 64}
HEADS["qwen3-30b-a3b-tpu-v6e-8.yaml"] = 32


def test_every_yaml_in_config_is_covered() -> None:
    assert {p.name for p in CONFIG_DIR.glob("*.yaml")} == {*DEPLOYMENTS, "smollm2-135m-cpu.yaml"}


@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_deployment_validates_and_fits_its_devices(name: str) -> None:
    layers, kv_heads, head_dim, params, expert_params, hbm, devices = DEPLOYMENTS[name]
    c = load_config(CONFIG_DIR / name)
    assert c.model.dtype == "bfloat16" and c.mesh.data * c.mesh.expert * c.mesh.model == devices
    assert kv_heads % c.mesh.model == 0, "KV heads must shard evenly (else the cache is replicated)"
    # Routed experts split over expert x model; the rest over model (replicated over expert).
    weights = (params - expert_params) * 2 / c.mesh.model + expert_params * 2 / (c.mesh.expert * c.mesh.model)
    kv = c.engine.num_pages * c.engine.page_size * layers * 2 * kv_heads * head_dim * 2 / c.mesh.model
    # Leave at least 15 % of each device's memory to activations, logits and XLA's buffers.
    assert weights + kv <= 0.85 * hbm, f"{(weights + kv) / GIB:.1f} GiB of {hbm / GIB:.0f}"
    # The cache holds several max-length sequences, and a step can fill the largest decode batch.
    assert c.engine.num_pages * c.engine.page_size >= 4 * c.model.max_model_len
    assert c.engine.max_num_batched_tokens >= c.engine.max_num_seqs
    # On its TPU or GPU, attention "auto" picks the Pallas kernel only if the shapes fit it.
    fit = gpu_fit if "h100" in name else pallas_fit
    assert fit(HEADS[name], kv_heads, head_dim, c.engine.page_size) is None


@pytest.mark.parametrize("name", [n for n, d in DEPLOYMENTS.items() if d[6] > 1])
def test_wrong_mesh_for_the_devices_is_one_line(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config(CONFIG_DIR / name)
    if len(jax.devices()) >= config.mesh.data * config.mesh.expert * config.mesh.model:
        pytest.skip("this process sees enough devices for the mesh")
    with pytest.raises(ConfigError, match=r"needs 8 devices, but \d+ cpu device\(s\) are visible"):
        Deployment.load(config)  # fails before the (absent) checkpoint is looked up
    assert serve.main(["--config", str(CONFIG_DIR / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: mesh data=1 x ") and "needs 8 devices" in err and "\n" not in err
