"""Mixture-of-Experts models served end to end: 32 greedy tokens equal transformers' under chunked
prefill, preemption and prefix caching (``served_parity``), and a MoE deployment's mesh checks."""

from __future__ import annotations

import pytest
from served_parity import check_served_greedy

from myserve.config import load_config
from myserve.errors import ConfigError
from myserve.runtime.deployment import check_expert_mesh


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_greedy_matches_transformers_through_the_engine(arch: str, tiny_checkpoints) -> None:
    check_served_greedy(tiny_checkpoints[arch])


def test_expert_axis_needs_a_moe_model_whose_experts_it_divides(tiny_checkpoints) -> None:
    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.models.loading import open_source

    moe = open_source(resolve_checkpoint(tiny_checkpoints["qwen3_moe"])).spec
    dense = open_source(resolve_checkpoint(tiny_checkpoints["llama3"])).spec
    check_expert_mesh(moe, 4)  # 8 experts over 4 devices
    with pytest.raises(ConfigError, match="must divide the model's 8 experts"):
        check_expert_mesh(moe, 3)
    with pytest.raises(ConfigError, match="needs a Mixture-of-Experts model; llama is dense"):
        check_expert_mesh(dense, 2)
    check_expert_mesh(dense, 1)
    assert load_config(None, ["mesh.expert=4"]).mesh.expert == 4
    with pytest.raises(ConfigError, match="mesh.expert must be >= 1"):
        load_config(None, ["mesh.expert=0"])
