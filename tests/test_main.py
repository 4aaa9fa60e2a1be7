"""The main job (`python -m solvax`) and the benchmark script run on a fresh process."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def clean_env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the entry points set the device count themselves
    return env


def test_python_m_solvax_prints_the_live_table():
    out = subprocess.run([sys.executable, "-m", "solvax"], capture_output=True, text=True,
                         env=clean_env(), timeout=600, check=True).stdout
    assert "8 CPU devices" in out
    lines = {line.split("  ")[0]: line.split() for line in out.splitlines() if "  " in line}
    pcg = lines["PCG"]
    assert pcg[1:5] == ["8", "2", "4", "2"]  # devices, primal, adjoint, per step
    single = lines["PCG, single_reduction=True"]
    assert single[2:7] == ["8", "1", "2", "1", "0"]  # ... and no all-gather


def test_benchmark_collectives_json(tmp_path):
    path = tmp_path / "table.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "benchmark_collectives.py"),
                    "--devices", "2", "8", "--json", str(path)],
                   capture_output=True, text=True, env=clean_env(), timeout=600, check=True)
    data = json.loads(path.read_text())
    rows = {(r["case"], r["devices"]): r for r in data["rows"]}
    for case in ("PCG", "PCG, single_reduction=True", "FGMRES(16) via linear_solve",
                 "batched tridiagonal, batch axis sharded"):
        two, eight = rows[(case, 2)], rows[(case, 8)]
        assert (two["primal"], two["adjoint"], two["per_step"]) == (
            eight["primal"], eight["adjoint"], eight["per_step"])
        assert eight["adjoint"] == 2 * eight["primal"] and eight["all_gathers"] == 0
