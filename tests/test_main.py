"""The main job (`python -m solvax`) and the benchmark script run on a fresh process."""

import json
import pathlib
import subprocess
import sys

import pytest
from helpers import entry_point_env

ROOT = pathlib.Path(__file__).resolve().parents[1]




def _main_job(tmp_path, *args):
    """`python -m solvax --json PATH *args`: (printed text, rows by case)."""
    path = tmp_path / "table.json"
    out = subprocess.run([sys.executable, "-m", "solvax", "--json", str(path), *args],
                         capture_output=True, text=True, env=entry_point_env(), timeout=600,
                         check=True).stdout
    assert "8 CPU devices" in out and "all-gathers (p+a)" in out and "halos/step" in out
    rows = {r["case"]: r for r in json.loads(path.read_text())["rows"]}
    for case in rows:
        assert case in out  # the printed table and the JSON are the same rows
    return out, rows


def _check_pcg_rows(rows):
    pcg = rows["PCG"]
    assert (pcg["devices"], pcg["primal"], pcg["adjoint"], pcg["per_step"]) == (8, 3, 6, 2)
    single = rows["PCG, single_reduction=True"]
    assert (single["primal"], single["adjoint"], single["per_step"],
            single["all_gathers"]) == (2, 4, 1, 0)


def test_python_m_solvax_prints_the_rows_asked_for(tmp_path):
    """The main job with `--case` (the whole table is the benchmark-stage test
    below; every row's counts are pinned in test_sharding.py and
    test_partitioned.py)."""
    cases = ["PCG", "PCG, single_reduction=True", "shard_map: MINRES (axis_name)"]
    out, rows = _main_job(tmp_path, "--case", *cases)
    assert list(rows) == cases
    _check_pcg_rows(rows)
    # each row is printed as it is measured, with its place and the time so far
    for i, case in enumerate(cases, 1):
        assert f"[{i}/{len(cases)}, " in out and f"] {case}: primal " in out
    assert rows["shard_map: MINRES (axis_name)"]["all_gathers"] == 0


def test_python_m_solvax_names_the_cases_for_an_unknown_one():
    out = subprocess.run([sys.executable, "-m", "solvax", "--case", "PCGG"],
                         capture_output=True, text=True, env=entry_point_env(), timeout=600)
    assert out.returncode == 2 and "unknown table cases ['PCGG']" in out.stderr
    assert "'PCG'" in out.stderr


@pytest.mark.benchmark
def test_python_m_solvax_prints_the_live_table(tmp_path):
    """The whole table, as the README's main command prints it."""
    _, rows = _main_job(tmp_path)
    assert len(rows) >= 45  # every row of the table (45 today)
    # recycling and refinement: one synchronization per Arnoldi step
    for case in ("GCRO-DR gcrot(m=16, k=4) (recycled space)",
                 "shard_map: gcrot(m=16, k=4) (axis_name)",
                 "iterative_refinement, float32 FGMRES(16) corrections"):
        assert rows[case]["per_step"] == 1 and rows[case]["all_gathers"] == 0, rows[case]
    _check_pcg_rows(rows)
    # a preconditioner adds no synchronization: Jacobi rows as the plain ones
    for method in ("", ", single_reduction", ", pipelined", ", s_step s=4"):
        jacobi = rows[f"PCG{method} + Jacobi"]
        assert jacobi["per_step"] == (2 if not method else 1) and jacobi["halos_per_step"] == 0
    # a pytree of two leaves sharded differently: one all-reduce per leaf per
    # reduction under jit (executed: the combiner's tuple is one rendezvous
    # per array on XLA:CPU), on both JAX versions
    assert rows["pytree PCG single_reduction, P('i') + P(None,'i')"]["per_step"] == 2
    # the multigrid rows: synchronizations (CG's all-reduces and the coarsest
    # grid's all-gathers) and halos per iteration exactly, the same on JAX
    # 0.10.2 and 0.4.38; the whole program (set-up included) at most what
    # either emits (0.10.2 / 0.4.38: 105 / 111 since symmetric storage; 110 /
    # 116 before; fusion barriers in the set-up once made the first 119, a
    # strided slice the 0.4.38 one 140)
    grid = "64x64 grid P('i', None)"
    for case, syncs, halos, most in (
            (f"multigrid-preconditioned CG, {grid}", 3, 32, 111),
            (f"multigrid-preconditioned CG, single_reduction, {grid}", 2, 32, 110),
            (f"multigrid-preconditioned CG, pipelined, {grid}", 2, 32, 178),
            (f"multigrid-preconditioned CG, s_step s=4, {grid}", 5, 128, 211),
            (f"multigrid-preconditioned CG, Chebyshev coarsest level, {grid}", 2, 46, 134),
            ("multigrid-preconditioned CG, 64x64 grid P('i', 'j') on 2x4", 6, 96, 279)):
        row = rows[case]
        assert (row["per_step"], row["halos_per_step"]) == (syncs, halos), row
        assert row["primal"] <= most, row
    assert rows[f"multigrid-preconditioned CG, Chebyshev coarsest level, {grid}"][
        "all_gathers"] == 0


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
