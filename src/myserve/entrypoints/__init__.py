"""The programs and their command lines: what a user runs, and what assembles the processes.

- ``cli.py``: the ``myserve`` console script (``myserve serve MODEL``, ``run-batch``, ``generate``);
- ``serve.py``, ``serve_args.py``, ``vllm_flags.py``: ``python -m myserve.serve``, its flags and
  vLLM's; ``engine_loading.py``: the engine a config describes (a core process and its client, or
  in this process), for ``serve``, ``run_batch`` and each Ray replica; ``hub.py``: hub ids
  downloaded before anything loads; ``memory_check.py``: several models checked to fit first;
- ``run_batch.py``: ``python -m myserve.run_batch``; ``generate.py``: ``python -m myserve.generate``;
- ``service.py``: ``GenerationService``, the engine core and its front half in the caller's process
  (Python callers, benchmarks, tests).

They run in the launching process; the ``python -m`` names stay those of the thin forwarding
modules at the package root.
"""
