"""Attention over the paged KV cache: the reference (any backend) and the Pallas kernels for TPU
and GPU, with the ragged batch metadata they read.

Imported by the engine-core process (through ``models/`` and ``runtime/``). It imports nothing
from myserve but ``errors``.
"""
