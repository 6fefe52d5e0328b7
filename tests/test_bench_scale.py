"""scripts/bench_scale.py runs end to end on its tiny shape: every step, the ratios to the floor
of the same round, the process tree's memory and the targets are written (no speed is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_scale_quick_writes_every_step(tmp_path):
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_scale.py"), "--quick", "--out", str(out),
                             "--workdir", str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(out.read_text())["results"][0]
    assert record["size"] == "tiny" and record["shards"] == 2
    (round_,) = record["rounds"]
    assert set(round_) == {"floor", "startup", "convert_no_verify", "verify", "convert_default"}
    assert round_["floor"]["over_floor"] == 1.0
    assert all(step["seconds"] > 0 and step["peak_pss_mb"] > 0 and step["peak_anon_mb"] > 0
               and step["storage_read_mb"] >= 0 for step in round_.values())
    assert "storage_read_over_bytes" in round_["verify"] and "storage_read_over_bytes" not in round_["startup"]
    assert set(record["targets"]) == {"convert_default_within_2x_floor", "verify_within_1.5x_floor",
                                      "peak_memory_within_1gb"}
    assert not (tmp_path / "work").exists()
