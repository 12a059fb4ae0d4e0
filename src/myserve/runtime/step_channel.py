"""The leader's step ops to the followers over a host socket (ZeroMQ), not over the devices.

With overlapped steps the leader hands step N+1 to the devices while step N still runs. A device
collective such as ``broadcast_one_to_all`` is queued on the devices behind the running step, so
sending step N+1's ops that way would wait for step N to finish and end the overlap on a
multi-process run. A ZeroMQ PUB socket on the leader carries the pickled op lists instead: sending
is a host-side copy into the socket's queue, and each follower's SUB socket receives them in order.

Set-up, once, when no step runs (``open``): the leader binds a PUB socket on a free port and sends
its address to the followers with one device broadcast; each follower connects and subscribes; the
leader waits until every subscription has arrived (an XPUB socket reports them), so no step is
published before a follower listens. Queues are unbounded (a slow follower delays, never drops).
"""

from __future__ import annotations

import time

import numpy as np
import zmq
from jax.experimental import multihost_utils

_ADDRESS_BYTES = 256
_STOP = b""
"""The message that ends the followers' loop (an op list is never empty once pickled)."""


class StepChannel:
    """One leader's PUB socket, or one follower's SUB socket, for the op lists of every step."""

    def __init__(self, socket: zmq.Socket, leader: bool):
        self.socket = socket
        self.leader = leader

    @staticmethod
    def open(leader: bool, host: str, followers: int, timeout_s: float) -> StepChannel:
        """Collective over every process: the leader publishes on ``host`` (an address the followers
        reach it at); returns once every follower is subscribed (ConnectionError after ``timeout_s``)."""
        context: zmq.Context = zmq.Context.instance()
        buf = np.zeros(_ADDRESS_BYTES, np.uint8)
        if leader:
            socket = context.socket(zmq.XPUB)
            socket.setsockopt(zmq.SNDHWM, 0)
            port = socket.bind_to_random_port("tcp://*")
            address = f"tcp://{host}:{port}".encode()
            buf[: len(address)] = np.frombuffer(address, np.uint8)
        buf = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=leader))
        if not leader:
            socket = context.socket(zmq.SUB)
            socket.setsockopt(zmq.RCVHWM, 0)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(buf.tobytes().rstrip(b"\0").decode())
            return StepChannel(socket, leader=False)
        deadline = time.monotonic() + timeout_s
        subscribed = 0
        while subscribed < followers:
            wait_ms = max(0, int(1000 * (deadline - time.monotonic())))
            if not socket.poll(wait_ms):
                socket.close(linger=0)
                raise ConnectionError(f"{subscribed} of {followers} followers subscribed to the step channel")
            if socket.recv()[:1] == b"\x01":  # a subscription (\x00 would be an unsubscription)
                subscribed += 1
        return StepChannel(socket, leader=True)

    def send(self, message: bytes | None) -> None:
        """Leader: publish one op list (``None``: tell the followers to stop)."""
        self.socket.send(_STOP if message is None else message, copy=False)

    def recv(self) -> bytes | None:
        """Follower: the next op list (``None``: the leader said stop)."""
        message = self.socket.recv()
        return None if message == _STOP else message
