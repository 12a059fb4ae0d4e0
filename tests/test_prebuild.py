"""Step executables built from the model's shapes before its weights are read (``serve``'s start).

The engine must run exactly those executables, and serve the same tokens as an engine that built its
steps after loading; executables built for other arrays are not taken.
"""

from __future__ import annotations

from concurrent.futures import Future

import jax

from myserve.runtime.executor import Executor, Prebuilt
from myserve.runtime.step_ops import CompileSteps
from myserve.testing import TINY_ENGINE, collect, start_service
from myserve.wire.params import SamplingParams

PROMPTS = [[5, 9, 23, 42, 7], [100, 3, 3, 8], [17] * 20]


def greedy(service) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [collect(service.submit(p, params))[0] for p in PROMPTS]


def test_prebuilt_steps_are_the_ones_that_run_and_serve_the_same_tokens(tiny_checkpoints) -> None:
    from myserve.bundled import bundled_gguf_path
    from myserve.config import load_config
    from myserve.entrypoints.service import GenerationService
    from myserve.runtime.deployment import Deployment

    engine = (*TINY_ENGINE, "engine.num_pages=64", "engine.compilation_cache_dir=null")
    model = [f"model.checkpoint={tiny_checkpoints['llama3']}", f"model.tokenizer={bundled_gguf_path()}"]
    dep = Deployment.load(load_config(None, [*model, "model.dtype=float32", *engine]), prebuild=True)
    built, _ = dep.prebuilt[0].result()
    early = GenerationService.from_deployment(dep)
    early.start(progress=lambda done, total: None)
    late = start_service(tiny_checkpoints["llama3"], *engine)
    try:
        executor = early.replicas[0].runner.device
        assert isinstance(executor, Executor)
        now, _ = early.replicas[0].runner.buckets.compile_ops()
        keys = executor.keys(now)  # every forward, head and prompt scorer warmup builds
        assert set(built) == set(keys)
        assert all(executor.executables()[key] is built[key] for key in keys)  # none built again
        assert greedy(early) == greedy(late)
    finally:
        early.shutdown()
        late.shutdown()


def test_executables_built_for_other_arrays_are_not_taken(tiny_checkpoints) -> None:
    from myserve.config import load_config
    from myserve.models.checkpoint import resolve_checkpoint
    from myserve.models.loading import load_model, open_source
    from myserve.models.sharding import axis_mapping
    from myserve.runtime.deployment import executor_for
    from myserve.runtime.mesh import make_mesh

    def abstract_executor(num_pages: int, prebuilt: Future[Prebuilt] | None = None) -> Executor:
        config = load_config(None, [f"model.checkpoint={tiny_checkpoints['llama3']}", f"engine.num_pages={num_pages}"])
        source = open_source(resolve_checkpoint(str(tiny_checkpoints["llama3"])))
        mesh = make_mesh(1, 1)
        mapping = axis_mapping(source.spec, mesh)
        model = load_model(source, mesh, mapping, abstract=True)
        assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree_util.tree_leaves(model))
        return executor_for(config, model, mesh, mapping, prebuilt)

    sentinel = object()
    built_for_64: Future[Prebuilt] = Future()
    built_for_64.set_result(({"shape": sentinel}, abstract_executor(64).build_all(CompileSteps(()))[1]))  # type: ignore[dict-item]
    assert abstract_executor(64, built_for_64)._take_prebuilt() == {"shape": sentinel}
    other: Future[Prebuilt] = Future()
    other.set_result(built_for_64.result())
    assert abstract_executor(128, other)._take_prebuilt() == {}  # another cache size: rebuilt
