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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from myserve.config import Config
    from myserve.frontend.core_client import CoreLink

logger = logging.getLogger("myserve.serve")


def run_front_end(config: Config, link: CoreLink, address: tuple[str, int], name: str) -> None:
    """The process's entry point: attach to the core, serve HTTP on ``address``, exit with the status."""
    from myserve.core.process import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until uvicorn's handlers (which ignore it too)
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from myserve.frontend.core_client import EngineClient
    from myserve.frontend.http_server import serve_http
    from myserve.serve import GIL_SWITCH_INTERVAL_S, front_tokenizer

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    service = EngineClient.attach(config, lambda: front_tokenizer(config), link)
    try:
        service.wait_loaded()
        service.start()  # the core is ready
        sock = socket.create_server(address, reuse_port=True)
    except BaseException as e:  # the first front end reports the core's verdict
        logger.error("front end %d: %s", link.index, e)
        service.shutdown()
        sys.exit(1)
    sys.exit(serve_http(config, service, name, sockets=[sock], follows_parent=True))
