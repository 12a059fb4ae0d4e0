"""``python -m myserve.bench.device``: the first command to run on a GPU or TPU.

It measures the device's ceilings through JAX (copy bandwidth: bytes read + written per second of
a large elementwise pass; square-matmul FLOP/s), then serves random-weight checkpoints written
with the bundled tokenizer through the engine (``GenerationService``, no HTTP) and sets each run's
tokens/s against the weight-read roofline::

    roofline tokens/s = concurrency x copy_bytes_per_s / (weight bytes + KV bytes read per decode step)

where the weight bytes are the active parameters' in their served form (narrow codes and scales
under int8 / int4; top-k of a MoE layer's experts) and the KV bytes those of every sequence's
context at half its generation. Runs: ``bf16-c1`` ... ``moe-c64`` (``device_plan.RUN_NAMES``;
``c`` = concurrency, ``4k`` = 64 prompts of 4,096 tokens) and one per shipped
``config/*h100.yaml`` deployment when the device has its memory. Each deployment runs in its own
child process (``device_worker``) with a time limit, so one that fails leaves the others.

On a CPU it runs tiny (automatically unless ``--full``): the 2-layer yardstick and a tiny MoE,
16 streams for the ``c64`` runs, 16 tokens, 128-token "long" prompts. Results: a table on stdout
and JSON at ``--output`` (default ``docs/bench/device-<card>-<date>.json``) of the shape
``{"device", "jax", "ceilings": {"copy_bytes_per_s", "matmul_flops_per_s"}, "overrides",
"tokenizer", "runs": [{"name", "concurrency", "prompt_tokens", "quantization", "tokens_per_s",
"roofline_tokens_per_s", "roofline_share", "steady_s", "decode_steps", "executables",
"step_calls", "loop_calls", "tokens_per_call", ...}]}``.

Every run is timed in the engine's steady state (``steady.py``): after its background builds (the
decode loops of K = ``engine.decode_steps`` tokens per call among them) and the first run of every
executable (``steady_s``: the wait; past ``--steady-timeout`` the deployment fails, naming what was
not built or primed). Each run says which executables its timed section called and how often
(``executables``) and the tokens per step call (one stream: its decode tokens per loop call); one
that contradicts the steady state (anything compiled while timed; K > 1 and no decode loop ran)
keeps its figures with an ``error`` and the command exits 1.

``--tokenizer DIR`` (an HF tokenizer folder with a chat template) replaces the bundled model's
tokenizer in the random checkpoints, so that the command runs where the 98 MB bundled GGUF is not
(the device tool carries 64 MiB): see docs/performance.md, "What a GPU session runs".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from myserve.bench.device_plan import FULL, TINY, Mode, Variant, config_variants, variants

_SOURCE_CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
"""The shipped deployments, when running from a source checkout."""


def card_slug(device_kind: str) -> str:
    """A file-name slug of a device kind: ``NVIDIA H200`` -> ``nvidia-h200``, ``cpu`` -> ``cpu``."""
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"


def child_env(platform: str | None, tiny: bool) -> dict[str, str]:
    """The environment of the child processes."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # As `serve`: memory is taken as needed, up to most of the device (the default 75 % is less
    # than a 8B model's weights and KV pool on an 80 GB card).
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    if tiny and platform == "cpu":
        # LLVM's cheap optimization: the tiny model's compiles take a third of the time (warmup
        # 37 -> 12 s on 2 cores) and its steps run as fast; the tiny run is a smoke test anyway.
        flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    return env


def _child(args: list[str], log: Path, timeout_s: float, env: dict[str, str]) -> str | None:
    """Run ``python -m myserve.bench.device_worker ARGS`` with its output in ``log``; None when it
    succeeded, else why not (with the log's last lines)."""
    with log.open("ab") as f:
        try:
            rc = subprocess.run(
                [sys.executable, "-m", "myserve.bench.device_worker", *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                env=env,
            ).returncode
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout_s:.0f} s (log: {log})"
    if rc == 0:
        return None
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-3:]
    if tail and re.match(r"^[\w.]+(Error|Exception): ", tail[-1]):  # a traceback's last line says it
        tail = [re.sub(r"^(\w+\.)+(?=\w+: )", "", tail[-1])]  # (without the exception's module)
    return f"exit {rc}: {' | '.join(tail)[-600:]} (log: {log})"


def _checkpoint(shape: str, dtype: str, workdir: Path, tokenizer: Path | None = None) -> Path:
    """A random checkpoint of ``shape`` in ``dtype`` under ``workdir``, written unless it is there,
    with ``tokenizer`` (an HF tokenizer folder) or else the bundled model's tokenizer."""
    from myserve.bench.random_checkpoint import make_random_llama

    directory = workdir / f"{shape}-{dtype}" if tokenizer is None else workdir / f"{shape}-{dtype}-own-tokenizer"
    if not (directory / "model.safetensors").exists():
        make_random_llama(shape, directory, dtype=dtype, tokenizer=tokenizer)
    return directory


def check_tokenizer(directory: Path) -> str | None:
    """Why ``directory`` cannot stand in for the bundled tokenizer (None when it can): the runs need
    an HF tokenizer folder whose tokenizer has a chat template (the chat prompts)."""
    from myserve.tokenizer import Tokenizer

    if not (directory / "tokenizer.json").is_file():
        return f"{directory}: no tokenizer.json (an HF tokenizer folder: tokenizer.json + tokenizer_config.json)"
    try:
        tokenizer = Tokenizer.load(directory)
    except Exception as e:  # noqa: BLE001 - reported as the reason
        return f"{directory}: {e}"
    if not tokenizer.has_chat_template:
        return f"{directory}: the tokenizer has no chat template (tokenizer_config.json's chat_template)"
    return None


def roofline(entry: dict[str, Any], copy_bytes_per_s: float, max_tokens: int) -> None:
    """Add the weight-read roofline and the share of it reached to a run's ``entry`` (in place)."""
    weights = entry.get("weight_read_bytes")
    if not weights:
        entry.setdefault("roofline_tokens_per_s", None)
        entry.setdefault("roofline_share", None)
        return
    c = entry["concurrency"]
    kv = c * (entry["prompt_tokens"] + max_tokens / 2) * entry["kv_bytes_per_token"]
    entry["kv_read_bytes"] = int(kv)
    entry["roofline_tokens_per_s"] = c * copy_bytes_per_s / (weights + kv)
    measured = entry.get("tokens_per_s")
    entry["roofline_share"] = measured / entry["roofline_tokens_per_s"] if measured else None


def run_variant(variant: Variant, mode: Mode, workdir: Path, env: dict[str, str], args: argparse.Namespace) -> list:
    """Every run of ``variant`` as a result entry (measured, failed with ``error``, or ``skipped``)."""
    base: dict[str, Any] = {"quantization": variant.quantization, "model": variant.shape, "max_tokens": mode.max_tokens}
    entries = {
        r.name: {"name": r.name, "concurrency": r.concurrency, "prompt_tokens": r.prompt_tokens} for r in variant.runs
    }
    failure = variant.skip
    measured: dict[str, dict[str, Any]] = {}
    if failure is None:
        dtype = mode.dtype if variant.config is None else "bfloat16"
        try:
            checkpoint = _checkpoint(variant.shape, dtype, workdir / "checkpoints", args.tokenizer)
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be written fails its runs only
            failure = f"writing the {variant.shape} checkpoint failed: {e}"
        else:
            timeout = args.timeout or (600.0 if variant.config else mode.timeout_s)
            job: dict[str, Any] = {
                "config": variant.config,
                # The step cache stays the engine's own (engine.compilation_cache_dir): variants of
                # the same engine settings share executables, and a second run is a warm start.
                "overrides": [f"model.checkpoint={checkpoint}", *variant.overrides, *args.set],
                "runs": [entries[r.name] for r in variant.runs],
                "max_tokens": mode.max_tokens,
                "trace_dir": str(args.trace_dir) if args.profile else None,
                "steady_timeout_s": args.steady_timeout or timeout / 2,
            }
            job_path, out = workdir / f"{variant.name}.job.json", workdir / f"{variant.name}.result.json"
            job_path.write_text(json.dumps(job))
            out.unlink(missing_ok=True)
            print(f"[device] {variant.name}: {len(variant.runs)} run(s), limit {timeout:.0f} s", file=sys.stderr)
            t0 = time.perf_counter()
            failure = _child(["engine", str(job_path), str(out)], workdir / f"{variant.name}.log", timeout, env)
            base["variant_wall_s"] = time.perf_counter() - t0
            if out.exists():
                measured = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    results = []
    for name, entry in entries.items():
        entry = {**entry, **base, **measured.get(name, {})}
        if name not in measured:
            entry |= {"tokens_per_s": None, ("skipped" if variant.skip else "error"): failure or "no result"}
        results.append(entry)
    return results


def format_table(doc: dict[str, Any]) -> str:
    """The roofline table of a results document."""
    c = doc["ceilings"]
    lines = [
        f"{doc['device']} (jax {doc['jax']}): copy {c['copy_bytes_per_s'] / 1e9:,.1f} GB/s, "
        f"matmul {c['matmul_flops_per_s'] / 1e12:,.2f} TFLOP/s",
        f"{'run':<22} {'c':>4} {'prompt':>6} {'quant':>5} {'tok/s':>10} {'roofline':>10} {'share':>7} "
        f"{'tok/call':>8}  note",
    ]
    for r in doc["runs"]:
        tps, roof, share = r.get("tokens_per_s"), r.get("roofline_tokens_per_s"), r.get("roofline_share")
        per_call = r.get("tokens_per_call")
        note = r.get("error") or r.get("skipped") or (f"warmup {r['warmup_s']:.1f} s" if "warmup_s" in r else "")
        lines.append(
            f"{r['name']:<22} {r['concurrency']:>4} {r['prompt_tokens']:>6} {r['quantization']:>5} "
            f"{'-' if tps is None else f'{tps:,.1f}':>10} {'-' if roof is None else f'{roof:,.0f}':>10} "
            f"{'-' if share is None else f'{share:.1%}':>7} {'-' if per_call is None else f'{per_call:.2f}':>8}  "
            f"{note[:100]}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m myserve.bench.device", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="tiny models and runs (the default on a CPU)")
    size.add_argument("--full", action="store_true", help="the full-size models even on a CPU")
    p.add_argument("--output", type=Path, help="results JSON (default docs/bench/device-<card>-<date>.json)")
    p.add_argument("--workdir", type=Path, help="checkpoints, step cache and logs (kept); default a temp dir")
    p.add_argument("--only", type=lambda v: [x for x in v.split(",") if x], help="run only these runs (names)")
    p.add_argument("--timeout", type=float, help="seconds per deployment (default 150 tiny, 420 full, 600 configs)")
    p.add_argument("--profile", action="store_true", help="trace a few steps per run with jax.profiler")
    p.add_argument(
        "--tokenizer", type=Path, metavar="DIR",
        help="an HF tokenizer folder (tokenizer.json + tokenizer_config.json with a chat template) for the "
        "random checkpoints instead of the bundled model's (a device without the 98 MB bundled GGUF)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, help="tokens per request (default 16 tiny, 128 full)")
    p.add_argument(
        "--steady-timeout", type=float, metavar="S",
        help="seconds a deployment may take after ready to finish its background builds and run every "
        "executable once, before any run is timed (default half its time limit); past it the runs fail",
    )  # fmt: skip
    p.add_argument("--config-dir", type=Path, default=_SOURCE_CONFIG_DIR, help="where the *h100.yaml deployments are")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="config override for every run, after the run's own (e.g. engine.attention_backend=pallas_ragged)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; 0 when every run that was not skipped measured something."""
    args = parse_args(argv)
    started = time.perf_counter()
    if args.tokenizer is not None:
        args.tokenizer = args.tokenizer.resolve()
        problem = check_tokenizer(args.tokenizer)
        if problem:
            print(f"error: --tokenizer {problem}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="myserve-device-") as tmp:
        workdir = (args.workdir or Path(tmp)).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        env = child_env(None, tiny=False)
        print("[device] measuring ceilings", file=sys.stderr)
        error = _child(["ceilings", str(workdir / "ceilings.json")], workdir / "ceilings.log", 300.0, env)
        if error:
            print(f"error: the ceilings did not run: {error}", file=sys.stderr)
            return 2
        ceilings = json.loads((workdir / "ceilings.json").read_text())
        mode: Mode = TINY if args.tiny or (ceilings["platform"] == "cpu" and not args.full) else FULL
        if args.max_tokens:
            mode = dataclasses.replace(mode, max_tokens=args.max_tokens)
        env = child_env(ceilings["platform"], tiny=mode is TINY)
        slug, day = card_slug(ceilings["device"]), dt.date.today().isoformat()
        output = args.output or Path("docs/bench") / f"device-{slug}-{day}.json"
        args.trace_dir = output.with_name(output.stem + "-traces")
        plan = variants(mode) + config_variants(mode, args.config_dir, ceilings.get("memory_bytes"))
        unknown = sorted(set(args.only or ()) - {r.name for v in plan for r in v.runs})
        if unknown:
            print(f"error: no run named {', '.join(unknown)}", file=sys.stderr)
            return 2
        runs = []
        for variant in plan:
            if args.only:
                variant = dataclasses.replace(variant, runs=tuple(r for r in variant.runs if r.name in args.only))
                if not variant.runs:
                    continue
            for entry in run_variant(variant, mode, workdir, env, args):
                roofline(entry, ceilings["copy_bytes_per_s"], mode.max_tokens)
                runs.append(entry)
    doc = {
        "device": ceilings["device"],
        "jax": ceilings["jax"],
        "ceilings": {k: ceilings[k] for k in ("copy_bytes_per_s", "matmul_flops_per_s")},
        "overrides": args.set,
        "tokenizer": None if args.tokenizer is None else str(args.tokenizer),
        "runs": runs,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(doc, indent=1) + "\n")
    print(format_table(doc))
    print(f"[device] {mode.name} mode, {time.perf_counter() - started:.0f} s; wrote {output}", file=sys.stderr)
    # A run measured outside the steady state it claims is reported (its ``error``) and fails too.
    return 0 if all(r.get("tokens_per_s") and "error" not in r for r in runs if "skipped" not in r) else 1


if __name__ == "__main__":
    sys.exit(main())
