"""The bundled SmolLM2 GGUF: greedy generation equals transformers ``generate`` on the same file."""

from __future__ import annotations

import pytest

from myserve.bench.quality import PARITY_PROMPTS
from myserve.bundled import bundled_gguf_path
from myserve.entrypoints.generate import greedy_generate
from myserve.tokenizer import Tokenizer


def _hf_greedy(hf_gguf_model, ids: list[int], tok: Tokenizer) -> list[int]:  # noqa: ANN001
    import torch

    with torch.no_grad():
        out = hf_gguf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=list(tok.eos_token_ids),
            pad_token_id=tok.eos_token_ids[0],
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_greedy_32_tokens_match_transformers(smollm2, hf_gguf_model, quantization: str) -> None:
    """Float32, and ``int4``: the file's Q4_1 blocks (and its Q8_0 table) kept narrow on device;
    widened inside each matmul they are the very weights transformers dequantizes, so greedy output
    is the same token for token."""
    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.models.loading import load_model, open_source
    from myserve.models.narrow import NarrowWeight

    model, mesh, mapping = smollm2
    if quantization != "none":
        model = load_model(open_source(resolve_checkpoint(None)), mesh, mapping, quantization=quantization)
        assert isinstance(model.layers[0].qkv_proj, NarrowWeight) and model.layers[0].qkv_proj.bits == 4
    tok = Tokenizer.load(bundled_gguf_path())
    for prompt in PARITY_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
        ours = greedy_generate(model, ids, 32, mesh=mesh, mapping=mapping, eos_ids=tok.eos_token_ids)
        theirs = _hf_greedy(hf_gguf_model, ids, tok)
        assert ours == theirs, (prompt, tok.decode(ours), tok.decode(theirs))
        assert len(ours) >= 8  # a real answer, not an immediate EOS
