"""Per-row sampling parameters, packed on the host into two matrices: one transfer each per call.

Thirteen small arrays (plus penalty slots and sampled-row weights) moved one by one cost ~0.1 ms
each on a GPU, more than a 1B model's decode step computes; the host fills one int32 and one float32
matrix instead, and ``runtime/step_arrays.py`` slices them back into ``SamplingArrays`` inside the jitted
sampler. No JAX here: the core fills them.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Protocol

import numpy as np

MAX_TOP_LOGPROBS = 20
"""Top logprobs a step returns per sampling row and per scored prompt token (a request asks for at most this many)."""
MAX_BIAS = 300  # logit_bias entries per request (OpenAI's limit)
MAX_BANNED = 32  # EOS + stop_token_ids banned while min_tokens is not reached

# Columns of the float matrix (then MAX_BIAS bias values) and of the int matrix (then MAX_BIAS bias
# ids and MAX_BANNED banned ids). Float columns are SamplingParams fields copied as they are.
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_FLOAT_DEFAULTS = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)  # greedy, nothing filtered, no penalty
INT_FIELDS = ("top_k", "seed", "choice", "position", "slot", "weight", "logprobs", "constrained", "steps", "ban_steps")
NUM_FLOATS, NUM_INTS = len(FLOAT_PARAMS), len(INT_FIELDS)
TOP_K, SEED, CHOICE, POSITION, SLOT, WEIGHT, LOGPROBS, CONSTRAINED, STEPS, BAN_STEPS = range(NUM_INTS)
_float_params = operator.attrgetter(*FLOAT_PARAMS)


class RowParams(Protocol):
    """What a sampling row reads of a request's parameters (the wire's ``SamplingParams`` has them)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def logprobs(self) -> int | None: ...


@dataclasses.dataclass
class SamplingRows:
    """The host side: ``rows`` rows, padding rows greedy and inert (weight 0, the scratch slot)."""

    ints: np.ndarray
    """[B, NUM_INTS + MAX_BIAS + MAX_BANNED] int32: INT_FIELDS (seed as its uint32 bits; logprobs 1
    when the row's request asked for logprobs; constrained 1 when a grammar masks the row; steps,
    the tokens the row decodes in a several-token call; ban_steps, for how many of them the banned
    ids are banned), bias ids, banned ids (EOS and stop ids: banned under ``min_tokens``, and where
    a several-token call stops the row)."""
    floats: np.ndarray
    """[B, 6 + MAX_BIAS] float32: FLOAT_PARAMS, bias values."""

    @staticmethod
    def empty(rows: int, scratch_slot: int) -> SamplingRows:
        """``rows`` padding rows."""
        ints = np.zeros((rows, NUM_INTS + MAX_BIAS + MAX_BANNED), np.int32)
        ints[:, NUM_INTS:] = -1
        ints[:, SLOT] = scratch_slot
        floats = np.zeros((rows, NUM_FLOATS + MAX_BIAS), np.float32)
        floats[:, :NUM_FLOATS] = _FLOAT_DEFAULTS
        return SamplingRows(ints, floats)

    def set_leading(
        self, params: Sequence[RowParams], seeds: Sequence[int], choices: Sequence[int], positions: Sequence[int]
    ) -> None:
        """Rows ``0..len(params)-1``: each request's float params, top_k, seed, choice and position,
        weight 1. Column-wise, one assignment per field: a 64-row step's rows take ~90 us of the host's
        step planning this way, ~240 us as per-row writes."""
        n = len(params)
        if not n:
            return
        self.floats[:n, :NUM_FLOATS] = [_float_params(p) for p in params]
        ints = self.ints[:n]
        ints[:, TOP_K] = [p.top_k for p in params]
        ints[:, LOGPROBS] = [p.logprobs is not None for p in params]
        ints[:, WEIGHT] = 1
        ints[:, STEPS] = 1
        ints[:, CHOICE] = choices
        ints[:, POSITION] = positions
        ints[:, SEED] = np.array([s & 0xFFFFFFFF for s in seeds], np.uint32).view(np.int32)

    def set_bias(self, row: int, ids: tuple[int, ...], values: tuple[float, ...]) -> None:
        """The row's logit_bias entries (at most MAX_BIAS)."""
        self.ints[row, NUM_INTS : NUM_INTS + len(ids)] = ids
        self.floats[row, NUM_FLOATS : NUM_FLOATS + len(values)] = values

    def set_banned(self, row: int, ids: tuple[int, ...], steps: int = 1) -> None:
        """Token ids forced to -inf in the row's first ``steps`` tokens of this call (at most
        MAX_BANNED are kept); with ``steps`` 0 they only end the row in a several-token call."""
        ids = ids[:MAX_BANNED]
        start = NUM_INTS + MAX_BIAS
        self.ints[row, start : start + len(ids)] = ids
        self.ints[row, BAN_STEPS] = steps


HEAD_MODES = ("argmax", "sample", "filter")
"""The sampler executables the host picks from per step (``head_mode``; ``runtime/model_step.py``):
``argmax``, every row greedy with nothing that edits its logits and no logprobs; ``sample``, logit
processing (bias, bans, penalties, grammar masks), logprobs, and a draw for rows with a
temperature (greedy rows take the argmax of their processed logits), min-p only; ``filter``, the
same with top-k/top-p thresholds."""


def head_mode(rows: np.ndarray, floats: np.ndarray, count: int) -> str:
    """The head executable the first ``count`` packed sampling rows need (``HEAD_MODES``), read
    from the packed matrices themselves (``ints`` [B, ...], ``floats`` [B, ...]): decided on the
    host, so that the device decides nothing."""
    ints, f = rows[:count], floats[:count]
    drawing = f[:, FLOAT_PARAMS.index("temperature")] > 0
    if not drawing.any():
        plain = (
            not ints[:, LOGPROBS].any()
            and not ints[:, CONSTRAINED].any()
            and not (ints[:, NUM_INTS : NUM_INTS + MAX_BIAS] >= 0).any()  # logit bias
            and not (ints[:, BAN_STEPS] > 0).any()  # ids banned under min_tokens
            and (f[:, FLOAT_PARAMS.index("presence_penalty")] == 0).all()
            and (f[:, FLOAT_PARAMS.index("frequency_penalty")] == 0).all()
            and (f[:, FLOAT_PARAMS.index("repetition_penalty")] == 1).all()
        )
        return "argmax" if plain else "sample"
    filtered = (ints[drawing, TOP_K] > 0) | (f[drawing, FLOAT_PARAMS.index("top_p")] < 1)
    return "filter" if filtered.any() else "sample"
