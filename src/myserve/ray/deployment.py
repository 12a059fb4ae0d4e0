"""The Ray Serve application a myserve config describes: the ingress in front of the engine
replicas, with the replicas' count (or autoscaling bounds), resources and routing from ``ray``.

``build_app(config)`` is what ``myserve serve --ray-replicas N`` runs; ``app_builder`` is the same
for Ray Serve's own ``serve run myserve.ray:app_builder config=... ray.replicas=2`` and its config
files (``applications: [{import_path: myserve.ray:app_builder, args: {...}}]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from myserve.config import Config, load_config, parse_overrides, with_overrides
from myserve.errors import ConfigError
from myserve.ray.ingress import Ingress
from myserve.ray.replica import EngineReplica

ROUTER_PATH = "myserve.ray.router:PrefixAffinityRouter"
"""The engine replicas' request router (imported by path: each handle's process imports it)."""


def build_app(config: Config, *, cluster_resources: Mapping[str, float] | None = None) -> serve.Application:
    """The application: ``Ingress`` bound to the ``EngineReplica`` deployment. ``cluster_resources``
    (default: the connected cluster's) decides ``ray.accelerator: auto``."""
    if not config.ray.enabled:
        raise ConfigError("ray: set ray.replicas (or ray.max_replicas) to serve on Ray Serve")
    engine = serve.deployment(name="EngineReplica", **replica_options(config, cluster_resources))(EngineReplica)
    ingress = serve.deployment(
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},  # it only relays bytes
        max_ongoing_requests=1_000_000,  # waiting for room is the engine replicas' router's job
    )(Ingress)
    return ingress.bind(engine.bind(config), config)


def replica_options(config: Config, cluster_resources: Mapping[str, float] | None = None) -> dict[str, Any]:
    """``serve.deployment`` options of the engine replicas."""
    ray = config.ray
    low, high = ray.bounds()
    options: dict[str, Any] = {
        "max_ongoing_requests": ray.max_ongoing_requests or 2 * config.engine.max_num_seqs,
        "health_check_period_s": ray.health_check_period_s,
        # Loading and compiling take minutes on an accelerator: the health check starts after it.
        "graceful_shutdown_timeout_s": config.server.drain_timeout_s,
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER_PATH,  # type: ignore[arg-type]  # (Ray types the field as a dict)
            request_router_kwargs={"imbalance": ray.prefix_imbalance, "use_prefix": ray.routing == "prefix"},
        ),
    }
    if ray.autoscaling:
        scaling: dict[str, Any] = {
            "min_replicas": low,
            "max_replicas": high,
            "initial_replicas": ray.replicas or low or 1,
            "target_ongoing_requests": ray.target_ongoing_requests,
            "upscale_delay_s": ray.upscale_delay_s,
            "downscale_delay_s": ray.downscale_delay_s,
            "look_back_period_s": ray.look_back_period_s,
        }
        if ray.metrics_interval_s != 10.0:  # deprecated by Ray 2.60 (a warning), yet what replicas push at
            scaling["metrics_interval_s"] = ray.metrics_interval_s
        options["autoscaling_config"] = AutoscalingConfig(**scaling)
    else:
        options["num_replicas"] = high
    options.update(placement(config, cluster_resources))
    return options


def placement(config: Config, cluster_resources: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The resources of one replica: ``ray.replica_cpus`` CPUs and, on an accelerator, one GPU or
    TPU chip per device of its mesh, reserved together on one node (a placement group of one
    bundle, as a tensor-parallel mesh needs all its devices in the replica's process)."""
    devices = config.mesh.data * config.mesh.model * config.mesh.expert
    accelerator = config.ray.accelerator
    if accelerator == "auto":
        if cluster_resources is None:
            import ray as ray_core

            cluster_resources = ray_core.cluster_resources() if ray_core.is_initialized() else {}
        accelerator = "gpu" if cluster_resources.get("GPU") else "tpu" if cluster_resources.get("TPU") else "none"
    cpus = config.ray.replica_cpus
    if accelerator == "none":
        return {"ray_actor_options": {"num_cpus": cpus}}
    resource = {"gpu": "GPU", "tpu": "TPU"}[accelerator]
    actor: dict[str, Any] = {"num_cpus": cpus}
    if resource == "GPU":
        actor["num_gpus"] = devices  # Ray sets CUDA_VISIBLE_DEVICES to these for the replica
    else:
        actor["resources"] = {"TPU": devices}
    return {
        "ray_actor_options": actor,
        "placement_group_bundles": [{"CPU": cpus, resource: devices}],
        "placement_group_strategy": "STRICT_PACK",
    }


def app_builder(args: Mapping[str, Any]) -> serve.Application:
    """For ``serve run myserve.ray:app_builder KEY=VALUE ...``: ``config`` names a deployment YAML
    (default: the bundled model's), every other key is a dotted config key (``ray.replicas=2``,
    ``model.checkpoint=/models/x``). Without a replica count it serves one replica."""
    args = dict(args)
    path = args.pop("config", None)
    # Values from a YAML config file arrive typed (null, numbers, lists); from the command line as text.
    overrides = {k: parse_overrides([f"{k}={v}"])[k] if isinstance(v, str) else v for k, v in args.items()}
    config = load_config(path)
    config = with_overrides(config, overrides, source="serve run args") if overrides else config
    if not config.ray.enabled:
        config = with_overrides(config, {"ray.replicas": 1}, source="serve run args")
    return build_app(config)
