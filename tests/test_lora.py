"""LoRA adapters: PEFT checkpoints (made with ``peft`` here, random weights of three ranks and target
sets) read into our fused layouts, served by one engine whose steps mix adapters and the base model
per token; greedy tokens of each adapter equal transformers' with the adapter merged, a batch
spread over the base and three adapters (more than the device's slots: they swap) equals each
request alone, the prefix cache keeps an adapter's pages to itself, and the OpenAI SDK names an
adapter as its model."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import openai
import pytest
from test_server import LiveServer

from myserve.frontend.app import create_app
from myserve.runtime.lora_files import read_adapter
from myserve.testing import TINY_ENGINE, collect, hf_greedy, make_tiny_checkpoint, start_service
from myserve.wire.params import SamplingParams

ADAPTERS = {  # name -> (rank, alpha, target modules, rsLoRA)
    "attn": (2, 4, ["q_proj", "v_proj"], False),
    "full": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp": (8, 16, ["gate_proj", "up_proj", "down_proj"], False),
}
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 19], [200, 201, 3, 4, 77, 1, 90, 45, 33, 12, 9, 60, 13]]
MAX_TOKENS = 8


def make_adapter(base: Path, directory: Path, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int):
    """A PEFT LoRA adapter of ``base`` with random A and B (so it changes the outputs)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    peft.get_peft_model(model, config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint("llama3", root / "base")
    adapters = {name: make_adapter(base, root / name, *spec, seed=i) for i, (name, spec) in enumerate(ADAPTERS.items())}
    return base, adapters


@pytest.fixture(scope="module")
def expected(files) -> dict[str | None, list[list[int]]]:
    """transformers' greedy tokens per prompt, for the base and each adapter merged into it."""
    import peft
    import torch
    import transformers

    base, adapters = files
    out: dict[str | None, list[list[int]]] = {}
    for name in (None, *adapters):
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[name]).merge_and_unload()
        model.eval()
        out[name] = [hf_greedy(model, p, MAX_TOKENS, (0,)) for p in PROMPTS]
    return out


@pytest.fixture(scope="module")
def service(files):
    base, adapters = files
    modules = ",".join(f'"{name}={path}"' for name, path in adapters.items())
    svc = start_service(
        base,
        *TINY_ENGINE,
        "engine.num_pages=128",
        "engine.enable_lora=true",
        "engine.max_loras=2",  # fewer slots than adapters: they swap in and out
        "engine.max_lora_rank=8",
        f"engine.lora_modules=[{modules}]",
        "engine.decode_steps=4",  # several tokens per call (built in the background): adapters inside the loop too
        "engine.enable_weight_updates=true",
    )
    yield svc
    svc.shutdown()


def greedy(adapter: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, adapter=adapter)


def test_peft_files_read_into_fused_layouts_equal_the_merged_weights(files) -> None:
    """Host level: x through our fused A/B stacks equals x through (merged - base) weights."""
    import torch
    import transformers

    from myserve.models.axes import ModelAxes
    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.models.loading import _layer_table, open_source

    base, adapters = files
    spec = open_source(resolve_checkpoint(base)).spec
    table = _layer_table(spec, ModelAxes.of(spec))
    import peft

    base_sd = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    rng = np.random.default_rng(0)
    for name, path in adapters.items():
        merged = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), path
        ).merge_and_unload()
        merged_sd = merged.state_dict()
        ours = read_adapter(name, path, spec, 8)
        assert ours.rank == ADAPTERS[name][0]
        for field, group in (("qkv_proj", "qkv"), ("o_proj", "o"), ("gate_up_proj", "gate_up"), ("down_proj", "down")):
            names, _, combine = table[field]
            for layer in range(spec.num_layers):
                got = [[sd[f"model.layers.{layer}.{n}"].numpy() for n in names] for sd in (base_sd, merged_sd)]
                w0, w1 = ((combine(*w) if combine else w[0]) for w in got)
                a, b = ours.layers[layer][f"{group}_a"], ours.layers[layer][f"{group}_b"]
                x = rng.standard_normal(a.shape[:-1]).astype(np.float32)
                n_in = a.ndim - 1
                want = np.tensordot(x, w1 - w0, axes=n_in)
                np.testing.assert_allclose(np.tensordot(np.tensordot(x, a, axes=n_in), b, axes=1), want, atol=1e-5)


def test_each_adapter_alone_equals_transformers_merged(service, expected) -> None:
    for name in (None, *ADAPTERS):
        for prompt, want in zip(PROMPTS, expected[name], strict=True):
            ids, _, _ = collect(service.submit(prompt, greedy(name)))
            assert ids == want, name
    assert expected["full"] != expected[None]  # the adapters change the outputs


def test_a_mixed_batch_equals_each_alone(service, expected) -> None:
    """12 requests at once over the base and three adapters (2 slots), the same prompts under each:
    a shared prefix page between adapters, or a slot swapped under a running request, would show."""
    jobs = [(name, i % 2) for i, name in enumerate([None, *ADAPTERS] * 3)]
    assert service.replicas[0].runner.device.background_builds_done(timeout=600)
    built = service.stats().compile_count
    streams = [service.submit(PROMPTS[p], greedy(name)) for name, p in jobs]
    for (name, p), stream in zip(jobs, streams, strict=True):
        assert collect(stream)[0] == expected[name][p], (name, p)
    stats = service.stats()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.compile_count == built  # adapters moving in and out of slots compile nothing
    assert service.replicas[0].scheduler.decode_steps == 4  # decodes ran 4 tokens per call


def test_unknown_adapter_is_refused(service) -> None:
    from myserve.wire.params import InvalidParams

    with pytest.raises(InvalidParams, match="does not exist"):
        service.submit(PROMPTS[0], greedy("nope"))


def test_the_sdk_names_an_adapter_as_its_model(service, files, expected) -> None:
    _, adapters = files
    live = LiveServer(create_app(service, served_model_name="tiny"))
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny", *ADAPTERS}
        assert cards["full"].model_extra["parent"] == "tiny" and cards["full"].model_extra["root"] == str(
            adapters["full"]
        )

        def ask(name: str) -> tuple[str, list[int]]:
            out = client.completions.create(
                model=name,
                prompt=PROMPTS[0],
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=0,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            )
            return out.model, [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

        # The SDK builds its response models' pydantic schemas on first use, and pydantic's rebuild
        # is not thread-safe (a first parse from 4 threads at once raised AttributeError in
        # `model_rebuild`): the base model answers first, then every adapter at once.
        answers = {"tiny": ask("tiny")}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers.update(zip(ADAPTERS, pool.map(ask, ADAPTERS), strict=True))
        for name, (model, ids) in answers.items():
            assert model == name
            assert ids == expected[None if name == "tiny" else name][0][: len(ids)]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt=PROMPTS[0], max_tokens=1)
    finally:
        live.stop()


def test_load_and_unload_while_requests_run(service, files, expected, monkeypatch) -> None:
    """vLLM's runtime endpoints (opt-in by its environment variable): an adapter loaded while
    others run answers as the same weights under their first name; one unloaded while its request
    runs lets that request finish, then is a 404; nothing compiles, no request is lost."""
    import httpx

    from myserve.frontend.routes import lora

    _, adapters = files
    monkeypatch.setenv(lora.ENV, "true")
    live = LiveServer(create_app(service, served_model_name="tiny"))
    built = service.stats().compile_count
    try:
        running = [service.submit(PROMPTS[i % 2], greedy(name)) for i, name in enumerate(["full", "mlp", None] * 2)]
        body = {"lora_name": "attn2", "lora_path": str(adapters["attn"])}
        loaded = httpx.post(f"{live.url}/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200 and "attn2" in loaded.text
        again = httpx.post(f"{live.url}/v1/load_lora_adapter", json=body)
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        bad = httpx.post(f"{live.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        in_flight = service.submit(PROMPTS[0], greedy("full"))
        gone = httpx.post(f"{live.url}/v1/unload_lora_adapter", json={"lora_name": "full"})
        assert gone.status_code == 200
        assert collect(in_flight)[0] == expected["full"][0]  # queued before the unload: it runs
        for (name, p), stream in zip(
            [(n, i % 2) for i, n in enumerate(["full", "mlp", None] * 2)], running, strict=True
        ):
            assert collect(stream)[0] == expected[name][p]
        assert collect(service.submit(PROMPTS[1], greedy("attn2")))[0] == expected["attn"][1]
        ids = {m["id"] for m in httpx.get(f"{live.url}/v1/models").json()["data"]}
        assert ids == {"tiny", "attn", "mlp", "attn2"}
        refused = httpx.post(
            f"{live.url}/v1/completions", json={"model": "full", "prompt": PROMPTS[0], "max_tokens": 2}
        )
        assert refused.status_code == 404
        missing = httpx.post(f"{live.url}/v1/unload_lora_adapter", json={"lora_name": "full"})
        assert missing.status_code == 404
        assert service.stats().compile_count == built
    finally:
        live.stop()
        # Put the module's adapters back as they were for any test after this one.
        service.request_adapter_update("full", str(adapters["full"]), lambda *_: None)
        service.request_adapter_update("attn2", None, lambda *_: None)


def test_tensor_parallel_two_gives_the_same_tokens(files) -> None:
    """The adapter stacks shard like the layers they modify: on 2 (fake) devices along the model
    axis, every adapter's greedy tokens are those of one device."""
    import json
    import subprocess
    import sys

    base, adapters = files
    worker = Path(__file__).with_name("lora_worker.py")
    modules = [f"{name}={path}" for name, path in adapters.items()]
    runs = {}
    for model in (1, 2):
        out = subprocess.run(
            [sys.executable, str(worker), str(base), str(model), *modules], capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs[model] = json.loads(out.stdout.strip().splitlines()[-1])
    # B of the fused q/k/v stacks splits its KV heads over the model axis, like the layer it modifies.
    assert "model" in runs[2]["specs"]["qkv_b"] and "model" not in runs[1]["specs"]["qkv_b"], runs[2]["specs"]
    assert runs[2]["tokens"] == runs[1]["tokens"]
    assert runs[1]["tokens"]["full"] != runs[1]["tokens"]["None"]


def test_adapters_survive_a_live_weight_update(service, files, expected) -> None:
    """A new version of the base weights (here the same files) keeps the adapters resident in its
    slots, and adapters swapped in after the update are written into the new version's stacks."""
    import asyncio

    base, _ = files
    error, info = asyncio.run(service.update_weights(str(base), "again", "finish"))
    assert error is None and info["version"] == "again"
    for name in (None, *ADAPTERS, *reversed(ADAPTERS)):  # 3 adapters through 2 slots: swaps after the update
        ids, _, _ = collect(service.submit(PROMPTS[1], greedy(name)))
        assert ids == expected[name][1], name
    assert service.stats().weights_version == "again"
