"""User-facing error types.

Every error a user can cause by what they configure or point us at is one of these, and its message
is a single line that names the offending key or file. Entry points print the message without a
traceback (``entrypoints/``).

Shared by every process role (launcher, front end, engine core, Ray replicas) and every layer.
"""


class MyserveError(Exception):
    """Base class of errors whose message is meant for the user as-is (one line, no traceback)."""


class ConfigError(MyserveError):
    """A configuration key is unknown, or a value has the wrong type or is out of range."""


class CheckpointError(MyserveError):
    """A checkpoint (HF directory, hub id, safetensors or GGUF file) cannot be loaded; names the file."""
