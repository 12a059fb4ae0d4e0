"""Shared fixtures: tiny random checkpoints (built once per session) and loaded models."""

from __future__ import annotations

import os
from pathlib import Path

# Tests run on the host CPU; keep JAX from probing for accelerators and keep its logs quiet.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# pytest-xdist runs one worker per core: torch's reference models (and numpy's BLAS) use one
# thread each rather than spinning OpenMP threads against the other worker's compiles.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The XLA:CPU flags a served engine takes on this host (single-threaded dots on two cores): every
# in-process engine then compiles what the servers the tests start compile, and shares their steps.
from myserve.runtime.cpu_threads import single_threaded_dots_on_small_hosts  # noqa: E402

single_threaded_dots_on_small_hosts()

import httpx  # noqa: E402
import pytest  # noqa: E402

from myserve.testing import TINY_ARCHES, make_tiny_checkpoint  # noqa: E402

# httpx's calls wait 5 s for a response by default (``httpx.post(...)`` binds this object). A request
# whose step shape is the first of its kind compiles while it runs, and on a loaded 2-core machine
# that can take longer: tests wait up to 2 minutes for a read instead. A test that checks for a
# hang passes a timeout of its own.
httpx._config.DEFAULT_TIMEOUT_CONFIG.read = 120.0


@pytest.fixture(scope="module", autouse=True)
def release_compiled_executables():
    """After each test file, once its engines are shut down, drop JAX's in-process caches of
    compiled executables. XLA:CPU maps each kernel of an executable into memory on its own, a
    process may hold 65,530 mappings, and a worker that runs dozens of files' engines (each with
    its decode calls) kept every executable any of them built alive in those caches until one
    aborted loading the next (``LLVM ERROR: Unable to allocate section memory``)."""
    yield
    import gc

    import jax

    gc.unfreeze()  # (an engine's start freezes what exists: its executables too, once shut down)
    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch name -> directory of a tiny random transformers checkpoint (float32)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in TINY_ARCHES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints: dict[str, Path]):
    """The tiny llama3-rope checkpoint loaded on a 1-device mesh: (model, mesh, mapping)."""
    return load_on_mesh(tiny_checkpoints["llama3"])


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M GGUF loaded on a 1-device mesh: (model, mesh, mapping)."""
    return load_on_mesh(None)


@pytest.fixture(scope="session")
def tiny_service(tiny_checkpoints: dict[str, Path]):
    """The tiny Llama behind a started GenerationService (TINY_ENGINE, 256 pages), shared by modules."""
    from myserve.testing import TINY_ENGINE, start_service

    svc = start_service(tiny_checkpoints["llama3"], *TINY_ENGINE, "engine.num_pages=256")
    yield svc
    svc.shutdown()


@pytest.fixture(scope="session")
def tiny_client(tiny_checkpoints: dict[str, Path]):
    """``tiny_service``'s engine in a core process of its own (``EngineClient``)."""
    from myserve.testing import TINY_ENGINE, start_client

    client = start_client(tiny_checkpoints["llama3"], *TINY_ENGINE, "engine.num_pages=256")
    yield client
    client.shutdown()


@pytest.fixture
def make_service(tiny_checkpoints: dict[str, Path]):
    """A factory of started tiny-Llama services (TINY_ENGINE plus the overrides given); each is shut
    down when the test ends. For engines a test must own: a small pool, a fault, a fresh jit cache."""
    from myserve.testing import TINY_ENGINE, start_service

    started = []

    def make(*overrides: str):
        svc = start_service(tiny_checkpoints["llama3"], *TINY_ENGINE, *overrides)
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.shutdown()


SMOL_TEST_ENGINE = (
    "model.max_model_len=512",
    "engine.num_pages=256",
    "engine.max_num_seqs=16",
    "engine.max_num_batched_tokens=128",
    "engine.token_buckets=[1,16]",
    "engine.context_buckets=[128,512]",  # short contexts in a 128-token loop: SmolLM2's steps ~2x faster
)


@pytest.fixture(scope="session")
def smol_client():
    """The bundled SmolLM2 served by an engine core in its own process (``EngineClient``), with the
    same engine settings as ``smol_service``: the front end's half of ``python -m myserve.serve``."""
    from myserve.testing import start_client

    client = start_client(None, *SMOL_TEST_ENGINE)
    yield client
    client.shutdown()


@pytest.fixture(scope="session")
def smol_service():
    """The bundled SmolLM2 behind a started GenerationService with small buckets (shared by modules)."""
    from myserve.testing import start_service

    svc = start_service(None, *SMOL_TEST_ENGINE)
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module", params=["in_process", "core_process"])
def service(request):
    """SmolLM2 served in this process, or by an engine core in its own process (as serve runs it):
    the HTTP suites that hold for both (test_conformance, test_input_ranges). Modules with a
    ``service`` of their own override it."""
    return request.getfixturevalue("smol_service" if request.param == "in_process" else "smol_client")


@pytest.fixture(scope="module")
def live(service):
    """``service`` behind the real app over uvicorn, as model ``smol``."""
    from test_server import LiveServer

    from myserve.frontend.app import create_app

    server = LiveServer(create_app(service, served_model_name="smol"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_tiny(tiny_checkpoints: dict[str, Path]):
    """transformers' float32 load of the tiny llama3 checkpoint: the reference of served parity tests."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama3"], dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_gguf_model(tmp_path_factory: pytest.TempPathFactory):
    """transformers' own load of the bundled GGUF (dequantized to float32): the parity reference.

    Reading the GGUF through transformers takes about 45 s of CPU (its reader parses the vocabulary
    twice); the first pytest-xdist worker to need it saves the result as a float32 checkpoint in
    the run's shared temporary directory, and the others load that (seconds), under a file lock."""
    import fcntl

    import torch
    import transformers

    from myserve.bundled import bundled_gguf_path

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by this run's workers
    saved = root / "hf-smollm2-from-gguf"
    with open(root / "hf-smollm2-from-gguf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if saved.exists():
            config = transformers.AutoConfig.from_pretrained(str(saved))
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(torch.load(saved / "weights.pt"))
            return model.eval()
        path = bundled_gguf_path()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        # transformers will not save a model it read from a GGUF: its config and state dict, then.
        partial = root / "hf-smollm2-partial"
        partial.mkdir(exist_ok=True)
        model.config.to_json_file(partial / "config.json")
        torch.save(model.state_dict(), partial / "weights.pt")
        os.rename(partial, saved)  # whole, or not there
        return model.eval()


def load_on_mesh(checkpoint, data: int = 1, model: int = 1):
    """Load a checkpoint in float32 on a (data, model) mesh; returns (model, mesh, mapping)."""
    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.models.loading import load_model, open_source
    from myserve.models.sharding import axis_mapping
    from myserve.runtime.mesh import make_mesh

    source = open_source(resolve_checkpoint(checkpoint))
    mesh = make_mesh(data, model)
    mapping = axis_mapping(source.spec, mesh)
    return load_model(source, mesh, mapping), mesh, mapping
