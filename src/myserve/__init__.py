"""myserve: an OpenAI-compatible LLM inference server on JAX."""

__version__ = "0.1.0"
