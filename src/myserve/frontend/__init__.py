"""The front-end process: the HTTP app (routers per endpoint family), the OpenAI schemas, responses
and SSE, output processing (detokenizer, stop strings, tool-call and reasoning parsers) and the
client of the engine core.

Imported by the front-end process (and by an in-process ``GenerationService`` for its output
processing). It may import ``wire/`` and the shared top-level modules (config, errors, tokenizer,
grammar, validation, subprocesses), never ``core/``, ``runtime/``, ``models/`` or ``ops/``: the
front-end process never loads JAX (``tests/test_layout.py``, ``tests/test_frontend_imports.py``).
"""
