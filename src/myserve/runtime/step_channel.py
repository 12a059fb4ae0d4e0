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
  start, the public keys travel over the deployment's own device collective
  (``process_allgather``, among the processes ``jax.distributed`` admitted), and the leader's ZAP
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

import msgspec
import numpy as np
import zmq
import zmq.auth.thread
from jax.experimental import multihost_utils

from myserve.runtime.executor import Op

logger = logging.getLogger(__name__)

_ADDRESS_BYTES = 256
_KEY_BYTES = 40
"""A Z85-encoded CURVE key."""
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
        row = np.zeros(_KEY_BYTES + _ADDRESS_BYTES, np.uint8)
        row[:_KEY_BYTES] = np.frombuffer(public, np.uint8)
        auth = None
        if leader:
            auth = zmq.auth.thread.ThreadAuthenticator(context, log=logger)
            auth.start()
            socket = context.socket(zmq.XPUB)
            socket.curve_server = True
            socket.curve_secretkey = secret
            socket.setsockopt(zmq.SNDHWM, 0)
            port = socket.bind_to_random_port(f"tcp://{host}")
            address = f"tcp://{host}:{port}".encode()
            row[_KEY_BYTES : _KEY_BYTES + len(address)] = np.frombuffer(address, np.uint8)
        rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, row.size)
        keys = [r[:_KEY_BYTES].tobytes() for r in rows]
        if not leader:
            address = rows[0, _KEY_BYTES:].tobytes().rstrip(b"\0")
            socket = context.socket(zmq.SUB)
            socket.curve_serverkey = keys[0]
            socket.curve_publickey = public
            socket.curve_secretkey = secret
            socket.setsockopt(zmq.RCVHWM, 0)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(address.decode())
            return StepChannel(socket, leader=False)
        assert auth is not None
        auth.configure_curve_callback("*", _FollowerKeys(set(keys[1:])))
        logger.info(
            "step channel: publishing on %s (CURVE server key %s, %d follower keys)",
            address.decode(),
            public.decode(),
            len(keys) - 1,
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
