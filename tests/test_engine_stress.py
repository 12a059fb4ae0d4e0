"""The engine under mixed traffic on a KV pool that forces preemption (tiny random Llama).

200+ requests mixing greedy and seeded sampling, penalties, logit_bias, n up to 4, stop strings,
logprobs, lengths up to the pool's capacity and random aborts. Every request not aborted finishes
with the right length and finish reason, nothing stays held afterwards, and seeded requests
(preempted penalty users among them) give the tokens they give when run alone.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from myserve.wire.params import SamplingParams

# The preemption test's engine (48 pages of 8 tokens = 384 tokens for 8 sequences of up to 256):
# same shapes, so no new executables to compile.
POOL = ("engine.num_pages=48", "model.max_model_len=256")
MAX_LEN = 256
NUM_REQUESTS = 210
STOP_CHARS = "aeiou{}xyz"


@dataclasses.dataclass
class Sent:
    """One request of the mix and what came back, per choice."""

    prompt: list[int]
    params: SamplingParams
    aborted: bool = False
    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    text: dict[int, str] = dataclasses.field(default_factory=dict)
    finish: dict[int, str | None] = dataclasses.field(default_factory=dict)
    stop_reason: dict[int, object] = dataclasses.field(default_factory=dict)
    logprobs: dict[int, int] = dataclasses.field(default_factory=dict)
    usage: object = None
    error: str | None = None


def make_mix(rng: np.random.RandomState) -> list[Sent]:
    sent = []
    for i in range(NUM_REQUESTS):
        length = int(rng.choice([rng.randint(1, 24), rng.randint(24, 120), rng.randint(120, 200)]))
        # Some requests reach the model's whole context, others stop early.
        max_tokens = MAX_LEN - length if i % 15 == 0 else int(rng.randint(1, min(40, MAX_LEN - length) + 1))
        greedy = rng.rand() < 0.35
        n = int(rng.choice([1, 1, 1, 2, 4]))
        penalties = rng.rand() < 0.4
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if greedy else float(rng.uniform(0.5, 1.3)),
            top_p=1.0 if greedy or rng.rand() < 0.5 else 0.9,
            top_k=0 if greedy or rng.rand() < 0.5 else 20,
            seed=None if (not greedy and rng.rand() < 0.15) else int(rng.randint(1 << 30)),
            n=n,
            presence_penalty=0.5 if penalties else 0.0,
            frequency_penalty=0.3 if penalties and rng.rand() < 0.5 else 0.0,
            repetition_penalty=1.2 if penalties and rng.rand() < 0.5 else 1.0,
            logit_bias=((int(rng.randint(17, 256)), 5.0), (2, -3.0)) if rng.rand() < 0.2 else (),
            stop=tuple(rng.choice(list(STOP_CHARS), 2, replace=False)) if rng.rand() < 0.2 else (),
            logprobs=int(rng.randint(0, 6)) if rng.rand() < 0.25 else None,
            ignore_eos=bool(rng.rand() < 0.3),
        )
        prompt = [int(t) for t in rng.randint(3, 256, size=length)]
        sent.append(Sent(prompt, params))
    return sent


def drain(service, sent: Sent, stream) -> None:
    for out in stream:
        if out.final:
            sent.usage, sent.error = out.usage, out.error
            continue
        c = out.choice
        sent.tokens.setdefault(c, []).extend(out.token_ids)
        sent.text[c] = sent.text.get(c, "") + out.text
        sent.logprobs[c] = sent.logprobs.get(c, 0) + len(out.logprobs or ())
        if out.finish_reason:
            sent.finish[c], sent.stop_reason[c] = out.finish_reason, out.stop_reason


def check_finished(sent: Sent, eos: tuple[int, ...]) -> None:
    p = sent.params
    assert sent.error is None, sent.error
    assert sorted(sent.finish) == list(range(p.n)), sent.finish
    for c in range(p.n):
        tokens, finish = sent.tokens[c], sent.finish[c]
        assert len(tokens) <= (p.max_tokens or 0)
        if finish == "length":
            assert len(tokens) == p.max_tokens
        else:
            assert finish == "stop", finish
            reason = sent.stop_reason[c]
            if reason is None:  # EOS
                assert not p.ignore_eos and tokens[-1] in eos
            else:
                assert reason in p.stop and reason not in sent.text[c]
        if p.logprobs is not None:
            assert sent.logprobs[c] == len(tokens)
    assert sent.usage is not None and sent.usage.completion_tokens == sum(len(t) for t in sent.tokens.values())


@pytest.mark.slow
def test_mixed_traffic_with_preemption_and_aborts(make_service) -> None:
    svc = make_service(*POOL)
    scheduler = svc.replicas[0].scheduler
    preempted: set[str] = set()
    schedule = scheduler.schedule

    def recording_schedule(weights: int = 0):
        batch = schedule(weights)
        preempted.update(seq.request_id for seq in batch.preempted if seq.params.uses_penalties)
        return batch

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    rng = np.random.RandomState(0)
    mix = make_mix(rng)
    streams, timers = [], []
    for sent in mix:
        stream = svc.submit(sent.prompt, sent.params)
        streams.append(stream)
        if rng.rand() < 0.1:  # aborted after a random delay: waiting, prefilling or decoding
            sent.aborted = True
            timer = threading.Timer(float(rng.uniform(0, 3.0)), svc.abort, args=(stream.request_id,))
            timer.start()
            timers.append(timer)
    threads = [threading.Thread(target=drain, args=(svc, s, st)) for s, st in zip(mix, streams, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for timer in timers:
        timer.join()
    assert not any(t.is_alive() for t in threads), "a request never finished"
    scheduler.schedule = schedule  # type: ignore[method-assign]

    eos = svc.tokenizer.eos_token_ids
    for sent in mix:
        if sent.aborted:
            assert sent.error is None and set(sent.finish.values()) <= {"abort", "length", "stop"}
        else:
            check_finished(sent, eos)
    stats = svc.stats()
    assert stats.num_preemptions > 0
    assert stats.pages_used == 0 and stats.running == 0 and stats.waiting == 0
    assert all(scheduler.allocator.refcount(p) == 0 for p in range(scheduler.allocator.num_pages))
    assert scheduler.slots.num_free == scheduler.slots.num_slots

    # Seeded (and greedy) requests alone give the tokens they gave in the crowd; preempted
    # penalty users first, then others up to a bounded count.
    candidates = [s for s in mix if not s.aborted and (s.params.seed is not None or s.params.temperature == 0)]
    names = {id(s): stream.request_id for s, stream in zip(mix, streams, strict=True)}
    chosen = [s for s in candidates if names[id(s)] in preempted]
    assert chosen, "no seeded penalty request was preempted: the pool does not press hard enough"
    chosen += [s for s in candidates if s not in chosen][: max(0, 30 - len(chosen))]
    for sent in chosen:
        alone = Sent(sent.prompt, sent.params)
        drain(svc, alone, svc.submit(sent.prompt, sent.params))
        assert alone.tokens == sent.tokens, f"{sent.params} preempted={names[id(sent)] in preempted}"
