"""``myserve serve ... --ray-replicas N``: start the Ray Serve application and serve until signalled.

Joins the cluster ``ray.address`` names (else a running local one, else starts one), starts Ray
Serve's HTTP proxy on ``server.host``/``server.port`` and deploys ``build_app(config)`` there.
SIGTERM/SIGINT delete the application (Ray Serve lets each replica finish its requests within
``server.drain_timeout_s``) and disconnect: a cluster this process started stops with it.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from myserve.config import Config

logger = logging.getLogger("myserve.ray")

APP_NAME = "myserve"


def run(config: Config) -> int:
    """Serve ``config`` on Ray Serve until signalled; the exit status."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print("error: ray is not installed: pip install 'myserve[ray]'", file=sys.stderr)
        return 2
    from myserve.ray.deployment import build_app

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(address=config.ray.address, ignore_reinit_error=True, log_to_driver=False)
    serve.start(http_options={"host": config.server.host, "port": config.server.port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    low, high = config.ray.bounds()
    count = f"{low}..{high} replicas (autoscaling)" if high > low else f"{high} replicas"
    logger.info("ready on http://%s:%d (Ray Serve, %s)", config.server.host, config.server.port, count)
    stop.wait()
    logger.info("stopping: deleting the application (replicas drain their requests)")
    serve.delete(APP_NAME)
    ray.shutdown()  # a cluster this process started stops with it; another one only loses the app
    return 0
