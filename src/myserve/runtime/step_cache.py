"""Step executables serialized on disk and found without tracing: the shortcut of a warm start.

JAX's persistent compilation cache keys an executable by its lowered module, so even a warm start
traces and lowers every step before it can look one up: 0.3-0.5 s of Python per step executable
on the 2-core CPU, which holds the GIL and ran as a serial chain in front of the loads (about 4 s of
CPU for the bundled model's buckets). This cache keys a serialized executable by what determines
that module instead:

- the myserve source (every ``.py`` file of the package), and the versions of the libraries that
  trace it (jax, jaxlib, equinox, haliax, numpy, ml_dtypes);
- JAX's configuration values and the XLA flags in the environment;
- the backend: platform, its version, and every device's kind;
- the step: its static arguments (shape, layer treedef, shardings) and the shape, dtype and
  sharding of every argument.

A miss (first start, another config, an edited source file) is lowered and compiled as before, and
the result stored here. Processes sharing the directory (replicas on one host, a restart beside a
running server, a test run's workers) build each entry once: the builder holds a claim on it (an
``flock``, released when it stores the entry or dies), and another process that misses the entry
builds its other steps first, then waits for the claim and loads what was stored.

JAX's own persistent cache stays off beside this one (``Deployment.load``): XLA:CPU re-serializes
an executable it loaded from that cache without its code. Only single-process deployments use it:
a multi-host executable spans devices of other processes.

Trust: the files are loaded with pickle (what ``jax.experimental.serialize_executable`` writes),
and an executable is code in any case, so whoever can write this directory runs code in the
server. ``check_trusted_directory`` (at start, for this cache and JAX's) refuses a directory that
is not the serving user's or that group or others may write, and directories are made 0700 and
files 0600. A damaged entry (truncated, corrupt, foreign) is a miss: built and stored again.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import logging
import os
import pickle
import stat
import tempfile
import zlib
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from myserve.errors import ConfigError

logger = logging.getLogger(__name__)

SUBDIRECTORY = "myserve-steps"
"""Where the entries live inside ``engine.compilation_cache_dir`` (JAX's cache reads only its own
``*-cache`` files there)."""

LOCKS = "myserve-step-locks"
"""Where the claims' lock files live, beside ``SUBDIRECTORY`` (whose every file is an entry)."""

_LIBRARIES = ("jax", "jaxlib", "equinox", "haliax", "numpy", "ml_dtypes")
_ENV_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TPU_LIBRARY_PATH")


class StepCache:
    """Serialized step executables under ``directory``, keyed by ``key(...)``."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory).expanduser() / SUBDIRECTORY

    @staticmethod
    def for_process(directory: str | os.PathLike[str] | None) -> StepCache | None:
        """The cache in ``engine.compilation_cache_dir``; none without one or on a multi-host mesh."""
        if directory is None or jax.process_count() > 1:
            return None
        return StepCache(directory)

    @staticmethod
    def key(static: Sequence[object], args: object) -> str:
        """The entry name of a step traced with ``static`` arguments for ``args`` (arrays or
        ``jax.ShapeDtypeStruct``s, with their shardings), in this process's environment."""
        h = hashlib.sha256(environment_digest().encode())
        # JAX's configuration can change during a process (tests do): read it for every key.
        h.update(repr(sorted((k, repr(v)) for k, v in jax.config.values.items())).encode())
        h.update(repr([(k, os.environ.get(k)) for k in _ENV_FLAGS]).encode())
        h.update(repr([(item, _devices(item)) for item in static]).encode())
        h.update(str(jax.tree_util.tree_structure(args)).encode())
        for leaf in jax.tree_util.tree_leaves(args):
            sharding = getattr(leaf, "sharding", None)
            h.update(repr((leaf.shape, str(leaf.dtype), sharding, _devices(sharding))).encode())
        return h.hexdigest()

    def claim(self, key: str, wait: bool) -> Claim | None:
        """The claim on building entry ``key`` among the processes sharing this cache, held until
        ``Claim.release`` (or this process's end); None if another process holds it and ``wait`` is
        false. A directory where the lock cannot be made gives a claim that excludes nobody."""
        try:
            locks = self.directory.parent / LOCKS
            locks.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(locks / key, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            logger.debug("no claim on step cache entry %s (%s): built without one", key, e)
            return Claim(None)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return Claim(fd)

    def has(self, key: str) -> bool:
        """Whether an entry is stored under ``key`` (it may still fail to load)."""
        return (self.directory / key).is_file()

    def load(
        self, key: str, args: object, out_tree: jax.tree_util.PyTreeDef, devices: Sequence[jax.Device]
    ) -> jax.stages.Compiled | None:
        """The executable stored under ``key``, loaded onto ``devices`` (its mesh's, in mesh order)
        for calls with ``args``; None on a miss or an unreadable entry. The treedefs come from the
        caller: pickling loses equinox's static fields."""
        path = self.directory / key
        try:
            blob = zlib.decompress(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, zlib.error) as e:
            logger.warning("step cache entry %s unreadable (%s): building the step again", path, e)
            return None
        try:
            compiled = serialize_executable.deserialize_and_load(
                blob, _in_tree(args), out_tree, execution_devices=list(devices)
            )
        except Exception as e:  # a corrupt or foreign entry: never worse than a miss
            logger.warning("step cache entry %s did not load (%s): building the step again", path, e)
            return None
        expected = [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args)]
        got = [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(compiled.args_info)]
        if got != expected:  # a key collision cannot happen by chance; this guards a stale writer
            logger.warning("step cache entry %s takes other arguments: building the step again", path)
            return None
        return compiled

    def store(self, key: str, compiled: jax.stages.Compiled, args: object, out_tree: jax.tree_util.PyTreeDef) -> None:
        """Write ``compiled`` under ``key`` (atomically) if it can be loaded back by ``load``."""
        try:
            blob, in_tree, got_out_tree = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError, jax.errors.JaxRuntimeError) as e:
            # A backend or executable without serialization; or, on XLA:CPU, one that has run (a
            # sort's comparator then is not serializable): JAX's in-process cache hands back the
            # executable an earlier engine of this process ran, for a step it compiles again.
            logger.debug("step executable not serializable (%s): not cached", e)
            return
        if in_tree != _in_tree(args) or str(got_out_tree) != str(out_tree):
            logger.warning("step executable's trees differ from the executor's: not cached (a stale out tree?)")
            return
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")  # 0600
            with os.fdopen(fd, "wb") as f:
                f.write(zlib.compress(blob, 1))  # 4.4 MB -> 0.8 MB for a 30-layer step; 10 ms to inflate
            os.replace(tmp, self.directory / key)
        except OSError as e:
            logger.warning("could not write the step cache in %s: %s", self.directory, e)


class Claim:
    """A held claim on building one step cache entry (``StepCache.claim``)."""

    def __init__(self, fd: int | None):
        self._fd = fd

    def release(self) -> None:
        """Let the next process waiting for this entry go on (closing the file drops the lock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check_trusted_directory(directory: str | os.PathLike[str], key: str = "engine.compilation_cache_dir") -> Path:
    """Make ``directory`` (0700) if it is missing and return it; ``ConfigError`` naming the path and
    the fix if another user could put an executable in it: it, and the step cache inside it, must be
    ours and not writable by group or others, and each directory above must be ours or root's and
    not writable by others unless sticky (as ``/tmp`` is)."""
    path = Path(directory).expanduser().absolute()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    uid = os.getuid()
    for own in (path, path / SUBDIRECTORY):
        try:
            info = own.stat()
        except FileNotFoundError:
            continue
        if info.st_uid != uid or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(
                f"{key} {own} is not safe to load executables from (owner uid {info.st_uid}, mode "
                f"{stat.S_IMODE(info.st_mode):o}): it must be owned by uid {uid} and not writable by group or "
                f"others; run 'chmod go-w {own}' if it is yours, or set {key} to a directory of your own"
            )
    for parent in path.parents:
        info = parent.stat()
        writable = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX
        if info.st_uid not in (uid, 0) or writable:
            raise ConfigError(
                f"{key} {path} lies under {parent}, which another user can change (owner uid {info.st_uid}, "
                f"mode {stat.S_IMODE(info.st_mode):o}): set {key} to a directory under one of your own"
            )
    return path


def _in_tree(args: object) -> jax.tree_util.PyTreeDef:
    """The treedef a compiled step's calls take: positional ``args``, no keywords."""
    return jax.tree_util.tree_structure((tuple(args), {}))  # type: ignore[arg-type]


def _devices(item: object) -> list[int] | None:
    """The device ids of a sharding, in its order: a sharding's repr names its mesh's axes, not
    which devices it spans (two data-parallel replicas differ only there)."""
    if isinstance(item, jax.sharding.NamedSharding):
        mesh_devices: Any = item.mesh.devices
        return [int(d.id) for d in mesh_devices.flat]
    if isinstance(item, jax.sharding.Sharding):
        device_set: Any = item.device_set
        return sorted(int(d.id) for d in device_set)
    return None


@cache
def environment_digest() -> str:
    """What every step of this process depends on besides its arguments and JAX's configuration
    (see the module doc): fixed for the life of the process."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    for name in _LIBRARIES:
        try:
            h.update(f"{name}={importlib.metadata.version(name)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{name}=none".encode())
    devices = jax.devices()
    client = devices[0].client
    h.update(repr((client.platform, client.platform_version, [(d.id, d.device_kind) for d in devices])).encode())
    h.update(pickle.dumps(None))  # the pickle protocol's default version shows up in the blobs
    return h.hexdigest()
