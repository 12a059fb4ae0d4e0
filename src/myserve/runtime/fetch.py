"""Device arrays to numpy: the executor's reads of a step's results."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np


def fetch(arrays: Sequence[jax.Array]) -> list[np.ndarray]:
    """Device arrays to numpy, all transfers started before any is awaited.

    On a multi-host mesh an output spans devices of other processes; every result here is
    replicated, so the local copy is the whole value.
    """
    if all(a.is_fully_addressable for a in arrays):
        return list(jax.device_get(list(arrays)))
    return [np.asarray(a.addressable_data(0)) for a in arrays]
