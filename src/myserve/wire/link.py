"""The addresses of one front end's link to the engine core: plain data that crosses processes."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CoreLink:
    """One front end's two sockets to the engine core (``ipc://`` addresses the front end binds)
    and the core's pid, which an attached front end watches. Picklable: ``serve`` hands links to
    the extra front-end processes of ``--api-server-count``, and the first front end hands them all
    to the core process it spawns."""

    index: int
    """Which front end (0 is the one that started the core); the core sends its outputs back there."""
    to_core: str
    """Front end -> core (requests, aborts)."""
    from_core: str
    """Core -> front end (outputs, heartbeats, lifecycle)."""
    core_pid: int = 0
    """The core's pid once it runs (0 before)."""
