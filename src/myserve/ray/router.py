"""Ray Serve's request router for the engine replicas: ``PrefixAffinity`` (``ray/affinity.py``)
decides, Ray Serve does the rest (probing queue lengths, waiting for room, retrying).

It runs in the ingress's process, one per handle. Each call the ingress makes carries a
``RouteHint`` as its first argument: the request's text (prefix affinity), or one replica to reach
(``/metrics`` asks each replica in turn). ``affinity.ROUTERS`` lets the ingress list the replicas
the router knows, to fan such calls out. Ray Serve ships this module to each handle's process by
value (a copy of its code), so it keeps no state of its own: the registry is another module's.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from myserve.ray import affinity
from myserve.ray.affinity import PrefixAffinity, RouteHint


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Sends a request to the replica holding the longest start of its text unless it is
    ``imbalance`` requests busier than the least loaded replica; otherwise to the least loaded."""

    def initialize_state(self, imbalance: int = 8, use_prefix: bool = True, **_: Any) -> None:
        """Ray Serve passes ``request_router_kwargs`` here."""
        self.policy = PrefixAffinity(imbalance, use_prefix=use_prefix)
        affinity.ROUTERS[self.app_name] = self

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The replicas to try, best group first."""
        hint = _hint(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if hint.replica is not None:
            return [[by_id[hint.replica]]] if hint.replica in by_id else []
        cache = self.replica_queue_len_cache
        loads = {uid: n for uid, r in by_id.items() if (n := cache.get(r.replica_id)) is not None}
        return [[by_id[uid] for uid in group] for group in self.policy.rank(hint.text, list(by_id), loads)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Remember that the replica now holds the request's text."""
        hint = _hint(pending_request)
        self.policy.routed(replica_id.unique_id, hint.text if hint.replica is None else None)
        if hint.request is not None:
            affinity.ASSIGNED[hint.request] = replica_id.unique_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """One request fewer in flight on the replica."""
        self.policy.completed(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """A replica that left (or died and was replaced) is forgotten: a new one holds nothing."""
        super().update_replicas(replicas)
        self.policy.keep_only([r.replica_id.unique_id for r in replicas])

    def replica_ids(self) -> list[str]:
        """The unique ids of the replicas requests can go to now."""
        return [rid.unique_id for rid in self.curr_replicas]


def _hint(pending_request: PendingRequest | None) -> RouteHint:
    if pending_request is not None and pending_request.args and isinstance(pending_request.args[0], RouteHint):
        return pending_request.args[0]
    return RouteHint()
