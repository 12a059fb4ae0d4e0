"""The device step: the plain-data contract of a step (``step_ops``, ``step_layout``,
``sampling_rows``, ``device``: no JAX), the jitted ragged step and sampler, the executor that
applies ops to the weights and the paged KV cache, buckets, the step cache, the mesh and
multi-host replay.

Imported by the engine-core process (and by multi-host followers, ``entrypoints/generate.py`` and the
benchmarks). It imports ``models/``, ``ops/`` and the shared top-level modules, never ``core/``,
``wire/`` or ``frontend/``: the core fills the contract this package defines.
"""
