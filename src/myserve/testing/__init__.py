"""Shared fakes for tests, in one place: tiny random checkpoints and transformers' answers on them
(``checkpoints``), started engines (``services``), and the engine core on a fake device
(``fake_core``). Only tests import this package; torch and JAX load only when a helper needs them."""

from myserve.testing.checkpoints import (
    NESTED_SCHEMA,
    TINY_ARCHES,
    TINY_COMMON,
    TINY_ENGINE,
    WEATHER_PARAMS,
    hf_greedy,
    hf_logits,
    make_tiny_checkpoint,
)
from myserve.testing.fake_core import FakeCore, FakeDevice, FakeTokenizer, assert_consistent, scripted_token
from myserve.testing.services import collect, start_client, start_service, streamed_and_not, wait_primed

__all__ = [
    "NESTED_SCHEMA",
    "WEATHER_PARAMS",
    "TINY_ARCHES",
    "TINY_COMMON",
    "TINY_ENGINE",
    "FakeCore",
    "FakeDevice",
    "FakeTokenizer",
    "assert_consistent",
    "collect",
    "hf_greedy",
    "hf_logits",
    "make_tiny_checkpoint",
    "scripted_token",
    "start_client",
    "start_service",
    "streamed_and_not",
    "wait_primed",
]
