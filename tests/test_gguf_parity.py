"""The bundled SmolLM2 GGUF: greedy generation equals transformers ``generate`` on the same file."""

from __future__ import annotations

import pytest

from myserve.bench.quality import PARITY_PROMPTS
from myserve.bundled import bundled_gguf_path
from myserve.generate import greedy_generate
from myserve.tokenizer import Tokenizer


@pytest.mark.slow
def test_greedy_32_tokens_match_transformers(smollm2, hf_gguf_model) -> None:
    import torch

    model, mesh, mapping = smollm2
    tok = Tokenizer.load(bundled_gguf_path())
    for prompt in PARITY_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
        ours = greedy_generate(model, ids, 32, mesh=mesh, mapping=mapping, eos_ids=tok.eos_token_ids)
        with torch.no_grad():
            out = hf_gguf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=list(tok.eos_token_ids),
                pad_token_id=tok.eos_token_ids[0],
            )
        theirs = out[0, len(ids) :].tolist()
        assert ours == theirs, (prompt, tok.decode(ours), tok.decode(theirs))
        assert len(ours) >= 8  # a real answer, not an immediate EOS
