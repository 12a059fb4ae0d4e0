"""A Python client of a myserve server (or any OpenAI-compatible one): ``Client`` and
``AsyncClient`` over httpx, with typed results, SSE streams, ``wait_ready`` and bounded retries
that never repeat a request the engine may have seen unless asked (``retry.py``).

Runs in the caller's process. It imports httpx and its own modules only: nothing of the server
(no JAX, no FastAPI), so a program that only talks to a server stays light
(``tests/test_client.py`` checks it). ``python -m myserve.client chat "question"`` streams an
answer to the terminal.
"""

from myserve.client.async_client import AsyncClient
from myserve.client.errors import APIError, ClientError, TransportError
from myserve.client.retry import RetryPolicy
from myserve.client.sync_client import Client
from myserve.client.types import Choice, Chunk, ChunkChoice, Completion, Embeddings, Usage

__all__ = [
    "APIError",
    "AsyncClient",
    "Choice",
    "Chunk",
    "ChunkChoice",
    "Client",
    "ClientError",
    "Completion",
    "Embeddings",
    "RetryPolicy",
    "TransportError",
    "Usage",
]
