"""How a MoE layer's tokens should reach the experts on an ``expert`` mesh axis: measured.

``python -m myserve.bench.moe_collectives`` runs one MoE MLP (``ops/moe.py``'s grouped matmul,
random weights) on a fake 8-device CPU mesh, experts split over ``--ep`` devices, three ways:

- ``replicated`` (what the server does, ``models/moe.py``): every device holds the step's tokens
  (they are replicated after the attention anyway); each runs its own experts on the assignments
  routed to them, and one ``psum`` of the [T, H] partial sums combines the devices.
- ``gather_scatter``: tokens arrive split over the devices ([T / ep, H] each): ``all_gather`` them,
  compute as above, ``psum_scatter`` the sums back to their owners.
- ``all_to_all``: tokens split as above; each device sends each of its assignments to the device
  owning its expert (``all_to_all`` of a [ep, C, H] buffer, C = T / ep * k rows per destination so
  that no assignment is ever dropped, however skewed the routing), runs its experts on what it
  received, and sends the results back with a second ``all_to_all``.

It prints the median step time of each. Fake CPU devices share one host's memory and cores, so
the figures rank the work each scheme does (what it computes and copies), not a real
interconnect's bandwidth; docs/performance.md reports and reads them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence


def _setup_devices(count: int) -> None:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    os.environ["JAX_PLATFORMS"] = "cpu"


def run(tokens: int, ep: int, experts: int, k: int, hidden: int, width: int, rounds: int) -> dict[str, float]:
    """Median milliseconds per MoE MLP call of each scheme (and a check that all three agree)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from myserve.ops.moe import expert_mlp, route

    mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(tokens, hidden).astype(np.float32))
    gate_up = jnp.asarray((rng.randn(experts, hidden, 2, width) * 0.05).astype(np.float32))
    down = jnp.asarray((rng.randn(experts, width, hidden) * 0.05).astype(np.float32))
    router = jnp.asarray(rng.randn(hidden, experts).astype(np.float32))
    local = experts // ep
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    gate_up, down = put(gate_up, P("expert")), put(down, P("expert"))
    act = jax.nn.silu

    def experts_here(xs: jax.Array, ids: jax.Array, w: jax.Array, gu: jax.Array, dn: jax.Array) -> jax.Array:
        first = jax.lax.axis_index("expert") * local
        return expert_mlp(xs, ids, w, gu, dn, act, first_expert=first)

    def replicated(x: jax.Array, gu: jax.Array, dn: jax.Array) -> jax.Array:
        w, ids = route(x @ router, k, True)
        return jax.lax.psum(experts_here(x, ids, w, gu, dn), "expert")

    def gather_scatter(xs: jax.Array, gu: jax.Array, dn: jax.Array) -> jax.Array:
        x = jax.lax.all_gather(xs, "expert", tiled=True)
        w, ids = route(x @ router, k, True)
        return jax.lax.psum_scatter(experts_here(x, ids, w, gu, dn), "expert", tiled=True)

    def all_to_all(xs: jax.Array, gu: jax.Array, dn: jax.Array) -> jax.Array:
        t = xs.shape[0]
        w, ids = route(xs @ router, k, True)
        cap = t * k  # rows per destination: all of this device's assignments, so none is dropped
        flat_ids, flat_w = ids.reshape(-1), w.reshape(-1)
        dest = flat_ids // local
        # Slot of each assignment in its destination's buffer: its rank among assignments to that device.
        onehot = jax.nn.one_hot(dest, ep, dtype=jnp.int32)
        slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
        token = jnp.arange(t * k) // k
        send_x = jnp.zeros((ep, cap, xs.shape[1]), xs.dtype).at[dest, slot].set(xs[token])
        send_id = jnp.full((ep, cap), -1, jnp.int32).at[dest, slot].set(flat_ids)
        recv_x = jax.lax.all_to_all(send_x, "expert", 0, 0, tiled=True)
        recv_id = jax.lax.all_to_all(send_id, "expert", 0, 0, tiled=True)
        rows = recv_x.reshape(ep * cap, -1)
        # Empty slots carry id -1: no local expert, so they are not computed.
        ys = experts_here(rows, recv_id.reshape(-1, 1), jnp.ones((ep * cap, 1), jnp.float32), gu, dn)
        back = jax.lax.all_to_all(ys.reshape(ep, cap, -1), "expert", 0, 0, tiled=True)
        return jnp.zeros((t, xs.shape[1]), jnp.float32).at[token].add(back[dest, slot] * flat_w[:, None])

    weights = (P("expert"), P("expert"))
    schemes: dict[str, tuple[Callable, P, P]] = {
        "replicated": (replicated, P(), P()),
        "gather_scatter": (gather_scatter, P("expert"), P("expert")),
        "all_to_all": (all_to_all, P("expert"), P("expert")),
    }
    results, outputs = {}, {}
    for name, (fn, x_spec, out_spec) in schemes.items():
        step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(x_spec, *weights), out_specs=out_spec, check_vma=False))
        xin = put(x, x_spec)
        outputs[name] = np.asarray(step(xin, gate_up, down))
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            step(xin, gate_up, down).block_until_ready()
            times.append((time.perf_counter() - t0) * 1e3)
        results[name] = statistics.median(times)
    for name, out in outputs.items():
        np.testing.assert_allclose(out, outputs["replicated"], atol=1e-3, rtol=1e-3, err_msg=name)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Print each scheme's median time for each token count."""
    p = argparse.ArgumentParser(prog="python -m myserve.bench.moe_collectives", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="8,64,512", help="tokens per step, comma-separated")
    p.add_argument("--ep", type=int, default=4, help="devices the experts are split over")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--k", type=int, default=4, help="experts per token")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--width", type=int, default=256, help="hidden width of one expert")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    _setup_devices(8)
    print(f"ep={args.ep} experts={args.experts} k={args.k} hidden={args.hidden} width={args.width} (ms, median)")
    print(f"{'tokens':>7} {'replicated':>11} {'gather_scatter':>15} {'all_to_all':>11}")
    for t in (int(v) for v in args.tokens.split(",")):
        r = run(t, args.ep, args.experts, args.k, args.hidden, args.width, args.rounds)
        print(f"{t:>7} {r['replicated']:>11.2f} {r['gather_scatter']:>15.2f} {r['all_to_all']:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
