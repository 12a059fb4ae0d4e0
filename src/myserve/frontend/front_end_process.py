"""An extra HTTP front-end process (``--api-server-count N``): the same app on the shared port,
attached to the engine core that the first front end started.

``serve`` starts the core for N front ends, listens on the port with a ``SO_REUSEPORT`` socket, and
spawns N-1 of these with their ``CoreLink``; each joins the port's socket group once the core is
ready (so that the kernel never hands it a connection before it can serve). Each one tokenizes,
detokenizes and streams its own requests; the core sends each front end the outputs of the requests
it sent. Life rules: it dies
with its parent (``PR_SET_PDEATHSIG``); it exits 1 when the core dies (it watches the core's pid);
it drains on the SIGTERM the first front end forwards, and ignores SIGINT (Ctrl-C reaches every
process of the group; the first front end decides).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from myserve.subprocesses import die_with_parent

if TYPE_CHECKING:
    from myserve.config import Config
    from myserve.tokenizer import Tokenizer
    from myserve.wire.link import CoreLink

logger = logging.getLogger("myserve.serve")

GIL_SWITCH_INTERVAL_S = 0.0005
"""The HTTP event loop shares its process's GIL with a thread that wakes up often (the engine
thread of an in-process engine; the core client's receiver): by default that thread waits up to
5 ms for the event loop to hand the GIL over, which delays the next step's dispatch. Measured on
the yardstick at 64 concurrent streams with the engine in process: +10 % tokens/s at 0.5 ms (3
alternating rounds). ``serve`` and every extra front end set it first thing."""


def run_front_end(
    config: Config,
    link: CoreLink,
    address: tuple[str, int],
    names: tuple[str, ...],
    load_tokenizer: Callable[[], Tokenizer],
) -> None:
    """The process's entry point: attach to the core, serve HTTP on ``address``, exit with the status.

    ``load_tokenizer`` (from ``serve``, picklable) loads the model's tokenizer as the deployment
    would, without the front end importing model code."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until uvicorn's handlers (which ignore it too)
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from myserve.frontend.core_client import EngineClient
    from myserve.frontend.request_log import set_log_levels

    set_log_levels(config.server.log_level, config.server.log_requests)
    from myserve.frontend.http_server import serve_http, served_model

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    service = EngineClient.attach(config, load_tokenizer, link)
    try:
        service.wait_loaded()
        service.start()  # the core is ready
        sock = socket.create_server(address, reuse_port=True)
    except BaseException as e:  # the first front end reports the core's verdict
        logger.error("front end %d: %s", link.index, e)
        service.shutdown()
        sys.exit(1)
    sys.exit(serve_http(config, [served_model(config, service, names)], sockets=[sock], follows_parent=True))
