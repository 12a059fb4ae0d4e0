"""The leader's step ops to the followers over a host socket (ZeroMQ), not over the devices.

With overlapped steps the leader hands step N+1 to the devices while step N still runs. A device
collective such as ``broadcast_one_to_all`` is queued on the devices behind the running step, so
sending step N+1's ops that way would wait for step N to finish and end the overlap on a
multi-process run. A ZeroMQ PUB socket on the leader carries the op lists instead: sending is a
host-side copy into the socket's queue, and each follower's SUB socket receives them in order.

Trust: the channel carries every request's token ids, and what a follower receives it runs on its
devices, so
- messages are typed data (``encode_step``/``decode_step``: the ops' msgspec Structs, arrays as
  dtype + shape + bytes of a few allowed dtypes), decoded strictly; anything else raises
  ``StepChannelError`` before a single op is built, and the follower stops;
- the leader binds one interface (the coordinator's host, or ``mesh.step_channel_host``), not all;
- the socket is a CURVE server (authenticated and encrypted): each process makes a key pair at
  start, the public keys (and the leader's address) go through ``jax.distributed``'s key-value
  store in the coordinator (among the processes it admitted), and the leader's ZAP
  handler admits only the followers' keys. A process outside the deployment cannot subscribe
  (no admitted key) nor pose as the leader (the followers check the leader's key). Secret keys never
  leave their process.

Set-up, once, when no step runs (``open``): the leader binds; every process shares its public key
and the leader its address; each follower connects and subscribes; the leader waits until every
subscription has arrived (an XPUB socket reports them), so no step is published before a follower
listens. Queues are unbounded (a slow follower delays, never drops).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import msgspec
import numpy as np
import zmq
import zmq.auth.thread

from myserve.runtime.step_ops import Op

logger = logging.getLogger(__name__)

_KEY_PREFIX = "myserve/step_channel"
"""Where the leader's address and everyone's public CURVE keys go in the distributed runtime's
key-value store."""
_STOP = b""
"""The message that ends the followers' loop (an encoded op list is never empty)."""

ARRAY_DTYPES = frozenset({"<i4", "<u4", "<f4", "|u1", "|b1"})
"""The dtypes an op's array may have on the wire (all that the ops use): a message naming any other
(objects above all) is refused."""


class StepChannelError(RuntimeError):
    """A message on the step channel that is not a step of ours: the follower stops."""


class StepMessage(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One replica's op list, as the leader publishes it."""

    replica: int
    ops: list[Op]


def _encode_array(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        return (array.dtype.str, array.shape, array.data.cast("B"))
    raise TypeError(f"not a step op field: {type(obj).__name__}")


def _decode_array(kind: type, obj: object) -> np.ndarray:
    if kind is not np.ndarray:
        raise TypeError(f"unexpected type {kind}")
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ValueError("an array is [dtype, shape, bytes]")
    dtype, shape, data = obj
    if dtype not in ARRAY_DTYPES:
        raise ValueError(f"array dtype {dtype!r} is not allowed")
    if not (isinstance(shape, list) and len(shape) <= 4 and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"bad array shape {shape!r}")
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * np.dtype(dtype).itemsize:
        raise ValueError("array bytes do not match its shape")
    return np.frombuffer(data, dtype).reshape(shape)


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_array)
_decoder = msgspec.msgpack.Decoder(StepMessage, dec_hook=_decode_array)


def encode_step(replica: int, ops: Sequence[Op]) -> bytes:
    """The wire form of one replica's op list."""
    return _encoder.encode(StepMessage(replica, list(ops)))


def decode_step(data: bytes, replicas: int) -> tuple[int, list[Op]]:
    """``(replica, ops)`` of a message from ``encode_step``; ``StepChannelError`` for anything else."""
    try:
        message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise StepChannelError(f"refused a step-channel message of {len(data)} bytes: {e}") from None
    if not 0 <= message.replica < replicas:
        raise StepChannelError(f"refused a step-channel message for replica {message.replica} of {replicas}")
    return message.replica, message.ops


class _FollowerKeys:
    """The leader's ZAP credentials check: only the deployment's followers' public keys."""

    def __init__(self, keys: set[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        if key not in self.keys:
            logger.warning("step channel: refused a subscriber whose CURVE key is not a follower's")
        return key in self.keys


def _key_value_store() -> Any:
    """The ``jax.distributed`` client: its key-value store lives in the coordinator, reached over the
    deployment's own connection (no device collective, nothing queued behind a step)."""
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise ConnectionError("jax.distributed is not initialized")
    return distributed.global_state.client


def _get(store: Any, key: str, timeout_ms: int) -> str:
    try:
        return str(store.blocking_key_value_get(f"{_KEY_PREFIX}/{key}", timeout_ms))
    except Exception as e:  # the runtime's own error type: a timeout, or the coordinator gone
        raise ConnectionError(f"no {key!r} in the key-value store: {' '.join(str(e).split())[:200]}") from None


class StepChannel:
    """One leader's PUB socket, or one follower's SUB socket, for the op lists of every step."""

    def __init__(self, socket: zmq.Socket, leader: bool, auth: zmq.auth.thread.ThreadAuthenticator | None = None):
        self.socket = socket
        self.leader = leader
        self._auth = auth

    @staticmethod
    def open(leader: bool, host: str, followers: int, timeout_s: float) -> StepChannel:
        """Collective over every process: the leader publishes on ``host`` (an address of its own
        that the followers reach); returns once every follower is subscribed (ConnectionError after
        ``timeout_s``)."""
        context = zmq.Context()  # its own: the ZAP handler below answers for every socket of a context
        public, secret = zmq.curve_keypair()
        store = _key_value_store()
        wait_ms = int(timeout_s * 1000)
        auth = None
        if leader:
            auth = zmq.auth.thread.ThreadAuthenticator(context, log=logger)
            auth.start()
            socket = context.socket(zmq.XPUB)
            socket.curve_server = True
            socket.curve_secretkey = secret
            socket.setsockopt(zmq.SNDHWM, 0)
            port = socket.bind_to_random_port(f"tcp://{host}")
            address = f"tcp://{host}:{port}"
            keys = {_get(store, f"follower/{i}", wait_ms).encode() for i in range(1, followers + 1)}
            # Admit the followers' keys before they learn where to connect: a connection the
            # handler refused (no keys yet) is not retried, and the follower would never subscribe.
            auth.configure_curve_callback("*", _FollowerKeys(keys))
            store.key_value_set(f"{_KEY_PREFIX}/leader", f"{address} {public.decode()}")
        else:
            store.key_value_set(f"{_KEY_PREFIX}/follower/{jax.process_index()}", public.decode())
            address, server_key = _get(store, "leader", wait_ms).split()
            socket = context.socket(zmq.SUB)
            socket.curve_serverkey = server_key.encode()
            socket.curve_publickey = public
            socket.curve_secretkey = secret
            socket.setsockopt(zmq.RCVHWM, 0)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(address)
            return StepChannel(socket, leader=False)
        assert auth is not None
        logger.info(
            "step channel: publishing on %s (CURVE server key %s, %d follower keys)",
            address,
            public.decode(),
            len(keys),
        )
        deadline = time.monotonic() + timeout_s
        subscribed = 0
        while subscribed < followers:
            wait_ms = max(0, int(1000 * (deadline - time.monotonic())))
            if not socket.poll(wait_ms):
                socket.close(linger=0)
                auth.stop()
                raise ConnectionError(f"{subscribed} of {followers} followers subscribed to the step channel")
            if socket.recv()[:1] == b"\x01":  # a subscription (\x00 would be an unsubscription)
                subscribed += 1
        return StepChannel(socket, leader=True, auth=auth)

    def send(self, message: bytes | None) -> None:
        """Leader: publish one encoded op list (``None``: tell the followers to stop)."""
        self.socket.send(_STOP if message is None else message, copy=False)

    def recv(self) -> bytes | None:
        """Follower: the next encoded op list (``None``: the leader said stop)."""
        message = self.socket.recv()
        return None if message == _STOP else message
