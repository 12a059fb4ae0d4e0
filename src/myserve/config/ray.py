"""The ``ray`` section of a deployment: many engine replicas behind one address on Ray Serve
(``myserve/ray/``). Its own module to keep ``schema.py`` readable; ``myserve.config`` re-exports it."""

import dataclasses

from myserve.config.fields import check, check_choice

ROUTINGS = ("prefix", "least_loaded")
"""``ray.routing`` values (``ray/affinity.py``)."""
ACCELERATORS = ("auto", "none", "gpu", "tpu")
"""``ray.accelerator`` values: which Ray resource each device of a replica's mesh takes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayConfig:
    """Ray Serve: how many engine replicas, how they scale, how requests reach them, where they run."""

    replicas: int = 0
    """Engine replicas on Ray Serve, each a whole myserve engine with its own device mesh; 0 = no
    Ray (this process serves). With max_replicas above min_replicas, the count it starts with."""
    min_replicas: int | None = None
    """Autoscaling: the fewest replicas (0 lets an idle application scale to none); null = replicas,
    or 1 when replicas is 0."""
    max_replicas: int | None = None
    """Autoscaling: the most replicas; null = replicas (a fixed count)."""
    target_ongoing_requests: float = 32.0
    """Autoscaling: the requests in flight per replica Ray Serve scales toward (queued ones count)."""
    max_ongoing_requests: int | None = None
    """Requests a replica takes at once before the router waits for room; null = twice
    engine.max_num_seqs (the engine queues the rest itself)."""
    upscale_delay_s: float = 30.0
    """Autoscaling: how long the load must ask for more replicas before one is added."""
    downscale_delay_s: float = 600.0
    """Autoscaling: how long the load must allow fewer replicas before one is removed."""
    metrics_interval_s: float = 10.0
    """Autoscaling: how often each replica reports its load."""
    look_back_period_s: float = 30.0
    """Autoscaling: the window the reported load is averaged over."""
    routing: str = "prefix"
    """prefix: a request goes to the replica that served the longest start of its text (its prefix
    cache holds it) unless that replica is prefix_imbalance requests busier than the least loaded;
    least_loaded: always the replica with the fewest requests in flight."""
    prefix_imbalance: int = 8
    """prefix routing: how many more requests in flight than the least loaded replica a replica may
    have and still get a request whose prefix it holds."""
    address: str | None = None
    """The Ray cluster to join (e.g. auto, or ray://head:10001); null = a running local cluster if
    there is one, else a new one."""
    replica_cpus: float = 1.0
    """CPUs Ray reserves for each replica."""
    accelerator: str = "auto"
    """The Ray resource each device of a replica's mesh takes: gpu, tpu or none (CPU only); auto =
    gpu or tpu when the cluster has them, else none."""
    health_check_period_s: float = 10.0
    """How often Ray Serve asks each replica whether its engine is alive (a dead one is replaced)."""

    def __post_init__(self) -> None:
        check(self.replicas >= 0, f"ray.replicas must be >= 0, got {self.replicas}")
        check_choice("ray.routing", self.routing, ROUTINGS)
        check_choice("ray.accelerator", self.accelerator, ACCELERATORS)
        low, high = self.bounds()
        check(low >= 0, f"ray.min_replicas must be >= 0, got {low}")
        if self.enabled:
            check(high >= max(low, 1), f"ray.max_replicas ({high}) must be >= 1 and >= ray.min_replicas ({low})")
        if self.replicas:
            check(low <= self.replicas <= high, f"ray.replicas ({self.replicas}) must lie in [{low}, {high}]")
        check(self.target_ongoing_requests > 0, "ray.target_ongoing_requests must be > 0")
        check(self.max_ongoing_requests is None or self.max_ongoing_requests >= 1, "ray.max_ongoing_requests >= 1")
        check(self.prefix_imbalance >= 0, f"ray.prefix_imbalance must be >= 0, got {self.prefix_imbalance}")
        check(self.replica_cpus >= 0, f"ray.replica_cpus must be >= 0, got {self.replica_cpus}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            check(getattr(self, name) >= 0, f"ray.{name} must be >= 0")
        for name in ("metrics_interval_s", "look_back_period_s", "health_check_period_s"):
            check(getattr(self, name) > 0, f"ray.{name} must be > 0")

    @property
    def enabled(self) -> bool:
        """Whether the server runs on Ray Serve (some replica count is set)."""
        return self.replicas > 0 or self.max_replicas is not None or self.min_replicas is not None

    def bounds(self) -> tuple[int, int]:
        """(fewest, most) replicas: equal unless autoscaling."""
        low = self.min_replicas if self.min_replicas is not None else max(self.replicas, 1)
        high = self.max_replicas if self.max_replicas is not None else max(self.replicas, low)
        return low, high

    @property
    def autoscaling(self) -> bool:
        """Whether Ray Serve scales the replica count with the load."""
        low, high = self.bounds()
        return high > low
