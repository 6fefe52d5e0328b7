"""The kernel benchmarks' CPU modes run and write their JSON where asked (a temp dir here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_bench_generate_cpu_quick(tmp_path):
    out = tmp_path / "bench_generate.json"
    done = run_script("scripts/bench_generate.py", "--cpu", "--quick", "--modes", "eager", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {(r["phase"], r["batch"], r["mode"]) for r in report["rows"]}
    assert rows == {("prefill", 2, "eager"), ("decode", 1, "eager"), ("decode", 2, "eager")}
    for row in report["rows"]:
        assert set(row) >= {"model", "phase", "batch", "mode", "original_ms", "converted_ms"}
        assert row["original_ms"] > 0 and row["converted_ms"] > 0
    (model,) = report["models"].values()
    assert model["max_rel_logit_diff"] < 1e-4  # the conversion is exact to float32 rounding


@pytest.mark.slow
def test_bench_generate_compiled_modes_trace_fullgraph(tmp_path):
    out = tmp_path / "bench_generate.json"
    done = run_script("scripts/bench_generate.py", "--cpu", "--quick", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    modes = {r["mode"] for r in json.loads(out.read_text())["rows"]}
    assert modes == {"eager", "compiled", "compiled-kernel"}


def test_bench_kernels_host_mode(tmp_path):
    out = tmp_path / "host.json"
    done = run_script("scripts/bench_kernels.py", "--host", "--quick", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    impls = {r["impl"] for r in rows}
    assert impls == {"normswap", "normswap_unplanned", "F.layer_norm", "F.rms_norm", "empty_like"}
    assert all(r["host_us"] > 0 for r in rows)


def test_bench_kernels_writes_nothing_without_out(tmp_path):
    done = run_script("scripts/bench_kernels.py", "--host", "--quick")
    assert done.returncode == 0 and "--out to keep the JSON" in done.stdout


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": str(tmp_path)}
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    for name in ("generate_small", "bench_kernels", "generate_1.3b", "tests"):
        assert f"{name} rc=0" in summary, summary
    for name in ("bench_generate-small-cpu.json", "bench_kernels-dry-run.json", "bench_generate-1.3b-cpu.json",
                 "tests.json"):
        assert (tmp_path / name).exists(), name
