"""Model architectures (the Llama family, Gemma 2 and 3), their weights' loading (safetensors, GGUF), quantized
weights and their sharding rules (``sharding.py``: one table of logical axes).

Imported by the engine-core process (through ``runtime/``). It imports ``ops/`` and the shared
top-level ``errors`` and ``bundled`` only, nothing from ``runtime/`` or above.
"""
