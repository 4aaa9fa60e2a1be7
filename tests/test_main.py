"""The main job (`python -m solvax`) and the benchmark script run on a fresh process."""

import json
import pathlib
import subprocess
import sys

import pytest
from helpers import entry_point_env

ROOT = pathlib.Path(__file__).resolve().parents[1]




def test_python_m_solvax_prints_the_live_table(tmp_path):
    path = tmp_path / "table.json"
    out = subprocess.run([sys.executable, "-m", "solvax", "--json", str(path)],
                         capture_output=True, text=True, env=entry_point_env(), timeout=600,
                         check=True).stdout
    assert "8 CPU devices" in out
    rows = {r["case"]: r for r in json.loads(path.read_text())["rows"]}
    for case in rows:
        assert case in out  # the printed table and the JSON are the same rows
    pcg = rows["PCG"]
    assert (pcg["devices"], pcg["primal"], pcg["adjoint"], pcg["per_step"]) == (8, 3, 6, 2)
    single = rows["PCG, single_reduction=True"]
    assert (single["primal"], single["adjoint"], single["per_step"],
            single["all_gathers"]) == (2, 4, 1, 0)


@pytest.mark.benchmark
def test_benchmark_collectives_json(tmp_path):
    """The benchmark's own code (several device counts, a choice of rows, the
    JSON) on five rows at 1 and 2 devices: every row at 8 devices is the live
    table above, and that the counts do not depend on the device count is
    pinned in tests/test_sharding.py."""
    path = tmp_path / "table.json"
    expected = {"PCG": (3, 6, 2), "PCG, single_reduction=True": (2, 4, 1),
                "FGMRES(16) via linear_solve": (3, 6, 1),
                "PCG, s_step s=4 (a step = 4 CG iterations)": (2, 4, 1),
                "batched tridiagonal, batch axis sharded": (0, 0, 0)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "benchmark_collectives.py"),
                          "--devices", "1", "2", "--json", str(path), "--case", *expected],
                         capture_output=True, text=True, env=entry_point_env(), timeout=600,
                         check=True).stdout
    data = json.loads(path.read_text())
    rows = {(r["case"], r["devices"]): r for r in data["rows"]}
    assert set(rows) == {(case, ndev) for case in expected for ndev in (1, 2)}
    for case, counts in expected.items():
        two, one = rows[(case, 2)], rows[(case, 1)]
        assert (two["primal"], two["adjoint"], two["per_step"]) == counts, case
        assert two["all_gathers"] == 0
        assert (one["primal"], one["adjoint"]) == (0, 0), case  # one device: no collective
        assert case in out
