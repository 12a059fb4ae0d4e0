"""The front-end process never loads JAX: every module of ``myserve.frontend`` and ``myserve.wire``
imports in a fresh interpreter without ``jax`` or ``jaxlib`` among its modules (milliseconds of
checking, about a second of importing; the running front end's memory maps are checked in
``test_core_process.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

_IMPORT_ALL = """
import importlib, json, pkgutil, sys
import myserve.frontend, myserve.wire
names = []
for package in (myserve.frontend, myserve.wire):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        names.append(info.name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib"))
print(json.dumps({"imported": names, "jax": loaded}))
"""


def test_the_front_end_and_the_wire_import_no_jax() -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    # The walk saw the packages' modules, subpackages included (a walk that found nothing passes vacuously).
    assert {"myserve.frontend.app", "myserve.frontend.routes.chat", "myserve.wire.messages"} <= set(result["imported"])
    assert result["jax"] == [], f"the front end imported {result['jax'][:5]}"
