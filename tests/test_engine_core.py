"""The engine core's finish and post-processing on a fake device (``FakeCore``: the real
``EngineCore``, scheduler and runner; scripted tokens; no JAX): EOS, stop token ids, length,
min_tokens, aborts, n > 1, prompt logprobs, overlap, grammar masks, and an engine error."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from myserve.grammar import GrammarSpec, matchers_alive
from myserve.testing import FakeCore, FakeDevice, assert_consistent, scripted_token
from myserve.wire.outputs import EngineDead
from myserve.wire.params import SamplingParams

EOS = 2
PROMPT = list(range(10, 17))


def script_at(tokens: dict[int, int]) -> FakeDevice:
    """A device drawing ``tokens[position]`` where given, the default script elsewhere."""
    return FakeDevice(lambda seed, choice, pos: tokens.get(pos, scripted_token(seed, choice, pos)))


@pytest.mark.parametrize("overlap", [False, True])
def test_each_token_level_finish_is_decided_by_the_core(overlap: bool) -> None:
    # Position 3 draws EOS, position 2 draws token 77.
    e = FakeCore(device=script_at({2: 77, 3: EOS}), overlap=overlap)
    e.submit(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=1), "eos")
    e.submit(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=1, stop_token_ids=(77,)), "stop-id")
    e.submit(PROMPT, SamplingParams(max_tokens=2, temperature=1.0, seed=1), "length")
    e.submit(PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=1, ignore_eos=True), "ignore-eos")
    e.run()
    eos, stop_id, length, ignored = (e.finished(r)[0] for r in ("eos", "stop-id", "length", "ignore-eos"))
    assert eos[1] == "stop" and eos[0][-1] == EOS and len(eos[0]) == 4
    assert stop_id[1] == "stop" and stop_id[0][-1] == 77 and len(stop_id[0]) == 3
    stop_output = next(o for o in e.outputs if o.request_id == "stop-id" and o.finish_reason)
    assert stop_output.stop_reason == 77  # which stop token ended it (vLLM's field); EOS gives None
    assert next(o for o in e.outputs if o.request_id == "eos" and o.finish_reason).stop_reason is None
    assert length == (length[0], "length") and len(length[0]) == 2
    assert ignored[1] == "length" and len(ignored[0]) == 5 and EOS in ignored[0]
    usage = next(o.usage for o in e.outputs if o.request_id == "eos" and o.final)
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (7, 4)
    assert_consistent(e.scheduler, e.live)
    assert e.scheduler.allocator.num_used == 0


def test_the_same_tokens_with_and_without_overlap() -> None:
    runs = []
    for overlap in (False, True):
        e = FakeCore(overlap=overlap, num_pages=12, budget=8)  # small: chunked prefills, preemption
        for i in range(4):
            e.submit([5 + i] * (6 + 3 * i), SamplingParams(max_tokens=9, temperature=1.0, seed=i, n=2), f"r{i}")
        e.run()
        runs.append({f"r{i}": e.finished(f"r{i}") for i in range(4)})
    assert runs[0] == runs[1]
    assert all(len(tokens) == 9 for request in runs[0].values() for tokens, _ in request.values())


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    e = FakeCore(device=FakeDevice(lambda seed, choice, pos: EOS if pos % 2 else 40))
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, min_tokens=4, stop_token_ids=(40,))
    e.submit(PROMPT, params, "min")
    e.run()
    tokens, finish = e.finished("min")[0]
    # Positions 0-3 may not end it: EOS and 40 were banned (the device drew the smallest allowed
    # id instead); position 4 draws 40, a stop id, and ends it.
    assert finish == "stop" and len(tokens) == 5 and tokens[-1] == 40
    assert EOS not in tokens[:4] and 40 not in tokens[:4]
    banned = [step.ints for step in e.device.steps]
    assert banned, "the min_tokens rows went to the device"


def test_n_choices_finish_independently_and_usage_closes_the_request() -> None:
    # Choice 1 draws EOS at position 1; the others run to max_tokens.
    device = FakeDevice(lambda seed, choice, pos: EOS if (choice, pos) == (1, 1) else 50 + pos)
    e = FakeCore(device=device, overlap=True)
    (parent, *siblings) = e.submit(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=2), "n3")
    e.run()
    got = e.finished("n3")
    assert got[1] == ([50, EOS], "stop")
    assert got[0] == ([50 + p for p in range(6)], "length") and got[2] == got[0]
    finals = [o for o in e.outputs if o.request_id == "n3" and o.final]
    assert len(finals) == 1 and finals[0].usage is not None and finals[0].usage.completion_tokens == 14
    assert [o.request_id for o in e.outputs].index("n3") >= 0 and e.outputs[-1].final  # usage comes last
    assert e.device.ops and any(type(op).__name__ == "CopyPage" for op in e.device.ops)  # siblings copy-on-write


def test_an_abort_of_one_choice_leaves_its_siblings_and_drops_its_token_in_flight() -> None:
    e = FakeCore(overlap=True)
    e.submit(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=4), "a")
    for _ in range(3):
        e.step()
    e.abort("a", 0)  # as the front end does when a stop string matched choice 0
    delivered = len(e.finished("a")[0][0])
    e.run()
    got = e.finished("a")
    assert got[0][1] == "abort" and len(got[0][0]) == delivered  # the token in flight was dropped
    assert got[1][1] == "length" and len(got[1][0]) == 8
    assert e.scheduler.allocator.num_used == 0 and e.scheduler.slots.num_free == e.scheduler.slots.num_slots


def test_prompt_logprobs_arrive_once_before_the_first_token() -> None:
    e = FakeCore(budget=4)  # the 7-token prompt is scored in two chunks
    e.submit(PROMPT, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1), "p")
    e.submit(PROMPT, SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=0), "only-prompt")
    e.run()
    for request_id in ("p", "only-prompt"):
        outs = [o for o in e.outputs if o.request_id == request_id and o.prompt_logprobs is not None]
        assert len(outs) == 1
        entries = outs[0].prompt_logprobs
        assert entries is not None and entries[0] is None and len(entries) == len(PROMPT)
        assert [entry.token_id for entry in entries[1:]] == PROMPT[1:]  # type: ignore[union-attr]
    assert e.finished("only-prompt")[0] == ([], "length")
    assert len(e.finished("p")[0][0]) == 2


def test_an_engine_error_fails_every_request_and_releases_their_pages() -> None:
    class Broken(FakeDevice):
        def read(self, output, **_):  # type: ignore[no-untyped-def]
            raise RuntimeError("device lost")

    e = FakeCore(device=Broken())
    e.submit(PROMPT, SamplingParams(max_tokens=4, temperature=0.0, n=2), "x")
    e.submit(PROMPT, SamplingParams(max_tokens=4, temperature=0.0), "y")
    e.core._loop()  # the engine thread's body: it ends on the error, failing every request
    assert isinstance(e.core.dead, RuntimeError)
    for request_id in ("x", "y"):
        assert {finish for _, finish in e.finished(request_id).values()} == {"error"}
        final = [o for o in e.outputs if o.request_id == request_id and o.final]
        assert len(final) == 1 and final[0].error is not None and "device lost" in final[0].error
    assert e.scheduler.allocator.num_used == 0
    with pytest.raises(EngineDead):
        e.submit(PROMPT, SamplingParams(max_tokens=1))


class ByteTokenizer:
    """A byte-level tokenizer of 257 ids (EOS, then one id per byte), made on the spot: what the
    core and its grammar compiler read of a tokenizer, without loading a model's."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        chars = sorted(pre_tokenizers.ByteLevel.alphabet())
        tokenizer = Tokenizer(models.BPE(vocab={"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        self.hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
        self.eos_token_ids = (0,)
        self.vocab_size = len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)


@pytest.fixture(scope="module")
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


def test_grammar_masks_reach_the_device_and_matchers_go_with_their_sequence(tokenizer: ByteTokenizer) -> None:
    vocab = tokenizer.vocab_size
    # Unconstrained, the script would draw ids >= 3 that spell no JSON; the device takes the
    # smallest id the row's mask allows instead, so the output follows the grammar.
    e = FakeCore(tokenizer=tokenizer, vocab_size=vocab, device=FakeDevice(vocab_size=vocab), max_model_len=512)
    grammar = GrammarSpec("regex", "(yes|no)")
    before = matchers_alive()
    e.submit(tokenizer.encode("Answer:"), SamplingParams(max_tokens=8, temperature=1.0, seed=1, grammar=grammar), "g")
    e.submit(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=1), "free")
    assert matchers_alive() == before + 1
    e.run()
    tokens, finish = e.finished("g")[0]
    assert tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids]) in ("yes", "no")
    assert finish == "stop" and tokens[-1] in tokenizer.eos_token_ids  # a complete grammar allows only EOS
    masked = [step for step in e.device.steps if step.bitmask is not None]
    assert masked and all(len(step.mask_rows) == 1 for step in masked)  # only the constrained row travels
    gc.collect()
    assert matchers_alive() == before  # the finished sequence dropped its matcher


def test_the_core_on_the_fake_device_imports_no_jax() -> None:
    code = (
        "import sys\n"
        "from myserve.testing import FakeCore\n"
        "from myserve.wire.params import SamplingParams\n"
        "e = FakeCore()\n"
        "e.submit([5, 6, 7], SamplingParams(max_tokens=3))\n"
        "e.run()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'torch', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
