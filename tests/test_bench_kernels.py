"""``python -m myserve.bench.kernels`` on CPU: tiny shapes, the kernels interpreted, every case within
bfloat16's rounding of its reference (the command a GPU session runs first, issue 46)."""

from __future__ import annotations

import json
from pathlib import Path

from myserve.bench import kernels


def test_every_kernel_case_runs_and_agrees_with_its_reference(tmp_path: Path, capsys) -> None:
    assert kernels.main(["--tiny", "--output", str(tmp_path / "k.json")]) == 0
    doc = json.loads((tmp_path / "k.json").read_text())
    names = [c["case"] for c in doc["cases"]]
    assert len(names) == 8 and any("prefill" in n for n in names) and any("int4 matmul" in n for n in names)
    for case in doc["cases"]:
        assert case["relative_diff"] is not None and case["relative_diff"] < 1e-2, case
        assert case["reference_s"] > 0 and case["kernel_s"] > 0
    assert "max |diff|" in capsys.readouterr().out
