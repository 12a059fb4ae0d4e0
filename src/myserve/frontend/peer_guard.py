"""Only the engine core may connect to a front end's sockets: ZeroMQ's ZAP with the kernel's peer
credentials.

The front end binds its two sockets to the core under abstract Unix socket names (Linux), which
vanish with the process (a SIGKILL leaves no file behind) but, having no file, have no permissions
either: any local process of any user could connect, take requests (prompts included) off the
PUSH socket, or push forged outputs into the PULL socket. So every connection to those sockets goes
through a ZAP handler first (ZeroMQ's authentication hook, RFC 27): for a Unix socket libzmq hands
the handler the peer's ``uid:gid:pid`` as the kernel reports it (``SO_PEERCRED``), which the peer
cannot forge. The handler accepts one process: the engine core, by pid, and only if it runs as our
own user. A refused peer never gets a pipe, so ZeroMQ routes no message to it and takes none from
it. We chose this over ``ipc://`` files in a private 0700 directory because nothing has to be
removed when a process is SIGKILLed, and because it also keeps out other processes of the same
user. Elsewhere (no abstract names) the sockets live in a 0700 temporary directory and the same
handler checks the uid when the kernel reports one.
"""

from __future__ import annotations

import logging
import os
import threading

import zmq

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends a context's ZAP requests (fixed by RFC 27)."""
DOMAIN = b"myserve-core"

_PID_WAIT_S = 30.0
"""How long a connection waits to be judged while the core's pid is not known yet (the core is being
spawned: it cannot connect before it exists, so this only covers the gap between fork and ``allow``)."""


def peer_credentials(address: bytes) -> tuple[int, int | None] | None:
    """``(uid, pid)`` from the address libzmq gives a ZAP handler for a Unix socket peer
    (``"<host>:<uid>:<gid>:<pid>"``; the pid is empty where the kernel has none); None without them."""
    parts = address.decode(errors="replace").rsplit(":", 3)
    if len(parts) != 4 or not parts[1].isdigit():
        return None
    return int(parts[1]), int(parts[3]) if parts[3].isdigit() else None


def allowed(address: bytes, uid: int, pid: int | None) -> bool:
    """Whether a peer at ``address`` is the process ``pid`` (any, if None) running as ``uid``."""
    credentials = peer_credentials(address)
    if credentials is None:
        return False
    peer_uid, peer_pid = credentials
    return peer_uid == uid and (pid is None or peer_pid is None or peer_pid == pid)


class PeerGuard:
    """A context's ZAP handler (a daemon thread): admits only ``allow``'s pid, of our own uid.

    ``protect(socket)`` before ``socket.bind``. The thread ends when the context is terminated.
    """

    def __init__(self, context: zmq.Context):
        self._pid: int | None = None
        self._known = threading.Event()
        self._uid = os.getuid()
        self._socket = context.socket(zmq.REP)
        self._socket.linger = 0
        self._socket.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="myserve-peer-guard", daemon=True)
        self._thread.start()

    @staticmethod
    def protect(socket: zmq.Socket) -> None:
        """Send every connection to ``socket`` through this context's handler (before ``bind``)."""
        socket.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)

    def allow(self, pid: int) -> None:
        """The one process that may connect: the engine core."""
        self._pid = pid
        self._known.set()

    def _serve(self) -> None:
        try:
            while True:
                version, request_id, domain, address, *_ = self._socket.recv_multipart()
                if not self._known.is_set():
                    self._known.wait(_PID_WAIT_S)
                ok = domain == DOMAIN and self._known.is_set() and allowed(address, self._uid, self._pid)
                if not ok:
                    logger.warning(
                        "refused a connection to the engine core's sockets from %s (only pid %s of uid %d may connect)",
                        address.decode(errors="replace"),
                        self._pid,
                        self._uid,
                    )
                status = (b"200", b"OK") if ok else (b"400", b"not the engine core")
                self._socket.send_multipart([version, request_id, *status, b"", b""])
        except zmq.ContextTerminated:
            pass
        finally:
            self._socket.close(linger=0)
