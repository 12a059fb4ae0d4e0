"""GenerationService on the bundled SmolLM2: concurrent greedy requests equal transformers alone."""

from __future__ import annotations

import pytest

from myserve.testing import hf_greedy
from myserve.wire.params import SamplingParams

TEXT = (
    "The history of the bicycle spans more than two centuries. Early designs had no pedals, and riders pushed "
    "themselves along with their feet. Later, cranks were fitted to the front wheel, which grew larger and larger "
    "until the safety bicycle, with its chain drive and equal wheels, took over. Pneumatic tyres made riding "
    "comfortable, and cycling clubs spread across Europe and America. Today bicycles are used for commuting, sport, "
    "delivery and leisure, and electric assistance has brought them to new riders in hilly cities everywhere. "
    "Engineers keep refining frames, gears and brakes, while planners build lanes so that people feel safe."
)


@pytest.mark.slow
def test_twelve_concurrent_greedy_requests_match_transformers(smol_service, hf_gguf_model) -> None:
    tok = smol_service.tokenizer
    words = tok.encode(TEXT + " " + TEXT)
    assert len(words) >= 200
    lengths = [3, 200, 17, 64, 5, 120, 33, 9, 150, 48, 77, 11]
    prompts = [words[:n] for n in lengths]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    streams = [smol_service.submit(p, params) for p in prompts]
    got = []
    for stream in streams:
        ids: list[int] = []
        for out in stream:
            ids.extend(out.token_ids)
        got.append(ids)
    for prompt, ours in zip(prompts, got, strict=True):
        assert ours == hf_greedy(hf_gguf_model, prompt, 8, tok.eos_token_ids), len(prompt)
    assert smol_service.stats().max_decode_batch > 1


@pytest.mark.slow
def test_chat_answer_streams_text(smol_service) -> None:
    tok = smol_service.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer with one word."}])
    text = "".join(out.text for out in smol_service.submit(ids, SamplingParams(max_tokens=10, temperature=0.0)))
    assert "Paris" in text
