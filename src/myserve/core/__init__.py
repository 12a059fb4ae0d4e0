"""The engine-core process: the engine loop (``engine_core.py``), the scheduler, pages and prefix
cache, penalty slots, sequences, grammar matchers, the runner that turns a scheduled batch into the
runtime's plain-data step, and the process entry (``process.py``).

Imported by the engine-core process (and by an in-process ``GenerationService``). It may import
``runtime/``, ``wire/`` and the shared top-level modules, never ``frontend/``. Only ``build.py``
(the core for a loaded deployment) and ``process.py`` touch JAX; the rest plans steps against the
runtime's ``Device`` contract, so its tests run on ``myserve.testing.FakeDevice``.
"""
