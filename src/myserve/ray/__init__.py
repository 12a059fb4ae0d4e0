"""myserve on Ray Serve (the ``ray`` extra): many engine replicas behind one address.

Code here runs in Ray's processes: ``ingress.py`` and ``router.py`` in the ingress replica,
``replica.py`` in each engine replica, ``launch.py`` in the process that starts the application.
``myserve serve MODEL --ray-replicas N`` (``launch.run``) or Ray Serve's own
``serve run myserve.ray:app_builder ray.replicas=N ...`` (``deployment.app_builder``) start it;
``docs/scaling-out.md`` says when to pick it over a router in front of plain servers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray import serve

__all__ = ["app_builder", "build_app"]


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Ray Serve's application builder (``serve run myserve.ray:app_builder KEY=VALUE ...``)."""
    from myserve.ray.deployment import app_builder as build

    return build(args)


def build_app(config: Any) -> serve.Application:
    """The Ray Serve application ``config`` (a ``myserve.config.Config``) describes."""
    from myserve.ray.deployment import build_app as build

    return build(config)
