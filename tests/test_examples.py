"""Every example runs at a small size, in a fresh process (as a user runs it)."""

import pathlib
import subprocess
import sys

import pytest
from helpers import entry_point_env

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def run(script, *args, cwd=None):
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                          text=True, env=entry_point_env(), timeout=600, check=True,
                          cwd=cwd).stdout



# Each example runs as a script in a fresh process: CI's stage for entry
# points (`pytest -m benchmark`), not the README's test command.
pytestmark = pytest.mark.benchmark

def test_poisson_sharded_prints_its_collectives():
    out = run("poisson_sharded.py", "--n", "64")
    assert "8 devices" in out and "CONVERGED" in out
    assert "all-reduce" in out  # the collective report
    error = float(out.split("exact solution: ")[1].split()[0])
    assert error < 1e-8, out  # the stencil is exact on the manufactured solution


def test_inverse_problem_fits_and_saves_a_picture(tmp_path):
    png = tmp_path / "inverse.png"
    out = run("inverse_problem.py", "--n", "16", "--steps", "15", "--png", str(png))
    first, last = (float(v) for v in out.split("loss ")[1].split(" in ")[0].split(" -> "))
    assert last < 0.2 * first, out
    assert png.stat().st_size > 10_000


def test_many_rhs_share_each_reduction():
    """The pinned claim: 1, 4 and 64 right-hand sides, the same collectives."""
    out = run("many_rhs.py", "--n", "512", "--batch", "64")
    rows = [line.split() for line in out.splitlines()
            if len(line.split()) == 3 and all(f.isdigit() for f in line.split())]
    counts = {(int(r[1]), int(r[2])) for r in rows}
    assert len(rows) == 3 and counts == {(2, 1)}, out
    assert "all converged: True" in out


def test_nonsymmetric_methods_all_converge():
    out = run("nonsymmetric.py", "--n", "32")
    rows = [line for line in out.splitlines() if "CONVERGED" in line]
    assert len(rows) == 7, out


def test_diffusion_3d_multigrid_beats_jacobi_iterations_with_halos_only():
    out = run("diffusion_3d_multigrid.py", "--n", "16")
    lines = {line.split()[0]: line for line in out.splitlines() if "iterations" in line}
    mg, jacobi = (int(lines[name].split(":")[1].split()[0]) for name in ("multigrid-CG",
                                                                         "Jacobi-CG"))
    assert "CONVERGED" in lines["multigrid-CG"] and mg <= 12 and jacobi > 3 * mg
    assert "all-to-all" not in out and "all-gather          1" in out


def test_bratu_newton_converges_sharded_with_multigrid():
    out = run("bratu_newton.py", "--n", "16")
    first = out.splitlines()[0]
    assert "CONVERGED" in first and "('i', None)" in first, out  # P(...) or PartitionSpec(...)
    steps = int(first.split(" in ")[1].split()[0])
    assert steps <= 8
    norms = [float(line.split("= ")[1]) for line in out.splitlines() if "||F(u)||" in line]
    assert len(norms) == steps + 1 and norms[-1] <= 1e-10 * norms[0]
    assert float(out.split("d mean(u) / d lambda = ")[1].split()[0]) > 0


def test_recycled_time_stepping_saves_iterations_and_keeps_the_sharding():
    out = run("recycled_time_stepping.py", "--n", "32", "--steps", "5", "--k", "6")
    totals = out.split("total matvecs: CG ")[1].split()
    plain, recycled = int(totals[0].rstrip(",")), int(totals[3])
    assert recycled < plain, out
    assert "(None, 'i')" in out and "all-gather" not in out
    assert "all-reduce 2" in out   # two per CG step, as plain CG
