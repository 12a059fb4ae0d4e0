"""Gemma 2, Gemma 3 (text) and Mistral with a sliding window, served: greedy tokens equal
transformers' through chunked prefill, preemption and prefix caching with prompts longer than the
16-token windows; Gemma's config keys as older transformers wrote them; and Gemma's chat template
through the real HTTP app."""

from __future__ import annotations

import httpx
import pytest
from served_parity import check_served_greedy
from test_server import LiveServer

from myserve.models.spec import LinearRopeScaling, spec_from_hf_config
from myserve.testing import TINY_ENGINE, make_tiny_checkpoint, start_service


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral_window"])
def test_served_greedy_matches_transformers(arch: str, tiny_checkpoints) -> None:
    check_served_greedy(tiny_checkpoints[arch])


BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16,
)  # fmt: skip


def test_legacy_gemma_configs() -> None:
    """Configs without ``layer_types`` or ``rope_parameters`` (as the hub's Gemma 2 and 3 ship):
    Gemma 2's even layers slide; Gemma 3 slides except every ``sliding_window_pattern``-th layer, its
    global layers on ``rope_theta`` with linear scaling, its sliding ones on ``rope_local_base_freq``;
    keys left out take transformers' defaults (tied embeddings, window 4096, soft caps 50 and 30)."""
    g2 = spec_from_hf_config({**BASE, "model_type": "gemma2", "query_pre_attn_scalar": 256}, "g2")
    assert g2.layer_types == ("sliding", "full") * 3 and g2.sliding_window == 4096
    assert g2.attn_softcap == 50.0 and g2.final_softcap == 30.0 and g2.tie_word_embeddings
    assert g2.hidden_act == "gelu_pytorch_tanh" and g2.query_scale == 256**-0.5 and g2.embed_scale == 8.0
    g3 = spec_from_hf_config(
        {
            **BASE, "model_type": "gemma3_text", "sliding_window": 512, "sliding_window_pattern": 3,
            "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "attn_logit_softcapping": 50.0,
        },
        "g3",
    )  # fmt: skip
    assert g3.layer_types == ("sliding", "sliding", "full") * 2
    kinds = g3.layer_kinds()
    assert kinds[0].window == 512 and kinds[0].rope_theta == 1e4 and kinds[0].rope_scaling is None
    assert kinds[2].window is None and kinds[2].rope_theta == 1e6
    assert kinds[2].rope_scaling == LinearRopeScaling(8.0)
    assert len(set(kinds)) == 2  # the step traces one layer function per kind
    assert g3.attn_softcap is None  # transformers' Gemma 3 attention never applies it
    assert g3.final_softcap is None and g3.qk_norm and g3.sandwich_norms and g3.norm_unit_offset


# Gemma 2's chat template as its instruction-tuned checkpoints ship it.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


@pytest.fixture(scope="module")
def gemma_live(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Gemma 2 (with SmolLM2's vocabulary size, so templated prompts fit) behind the real app,
    its chat template Gemma 2's (``model.chat_template``), as model ``gemma``."""
    from myserve.frontend.app import create_app

    root = tmp_path_factory.mktemp("gemma_chat")
    checkpoint = make_tiny_checkpoint("gemma2", root / "ckpt", vocab_size=49152)
    template = root / "gemma2.jinja"
    template.write_text(GEMMA2_TEMPLATE)
    svc = start_service(checkpoint, *TINY_ENGINE, "engine.num_pages=64", f"model.chat_template={template}")
    server = LiveServer(create_app(svc, served_model_name="gemma"))
    yield server, svc
    server.stop()
    svc.shutdown()


def test_gemma_chat_template_renders_and_generates(gemma_live) -> None:
    server, svc = gemma_live
    messages = [
        {"role": "user", "content": "Hi there "},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    expected = (
        f"{svc.tokenizer.hf.bos_token}<start_of_turn>user\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nHow are you?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    with httpx.Client(base_url=server.url, timeout=120) as http:
        tokens = http.post("/tokenize", json={"model": "gemma", "messages": messages}).json()
        rendered = http.post("/detokenize", json={"model": "gemma", "tokens": tokens["tokens"]}).json()["prompt"]
        assert rendered == expected
        reply = http.post(
            "/v1/chat/completions",
            json={"model": "gemma", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    usage = body["usage"]
    assert usage["prompt_tokens"] == tokens["count"] and usage["completion_tokens"] == 8
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert body["choices"][0]["finish_reason"] == "length"


def test_gemma2_template_refuses_a_system_message_with_a_400(gemma_live) -> None:
    server, _ = gemma_live
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json={"model": "gemma", "messages": messages, "max_tokens": 4})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "System role not supported" in error["message"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
