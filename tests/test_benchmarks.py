"""Smoke tests: every benchmark script runs on a tiny problem (no timing asserted)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import solvax as sx

pytestmark = pytest.mark.benchmark
BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def run(script, *args):
    """Run a benchmark script in a fresh process. No compilation cache (the
    scripts time compiles, and a cached compile is not one) and no device
    count (each script sets its own: the multigrid one runs on one device,
    where its hierarchy differs); but the tests' compile flags (the rest of
    `conftest.TEST_XLA_FLAGS`). A smoke run asserts no time, and its compiles
    were most of this stage: the multigrid script took 146 s with the
    default flags, 71 s with LLVM level 0 and the older CPU emitters."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["XLA_FLAGS"] = " ".join(flags)
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def test_benchmark_convergence_small(tmp_path):
    path = tmp_path / "conv.json"
    out = run("benchmark_convergence.py", "--small", "--json", str(path),
              "--plot", str(tmp_path / "conv.png"))
    assert (tmp_path / "conv.png").stat().st_size > 10_000
    results = json.loads(path.read_text())["results"]
    assert {r["solver"] for r in results} >= {"pcg standard", "pcg pipelined", "gmres cgs2",
                                              "gmres one_sync", "bicgstab one_sync", "idrs s=4",
                                              "minres", "scipy minres"}
    # scipy's MINRES steps are a reference; the high-contrast problem (condition
    # 5e7 at this size) is there to show which variants fail, and how
    ours = [r for r in results if r["status"] != "reference"
            and not r["problem"].startswith("high-contrast")]
    contrast = [r for r in results if r["problem"].startswith("high-contrast")]
    assert {r["solver"] for r in contrast} >= {"pcg standard", "pcg s_step s=4 chebyshev"}
    assert all(r["status"] != "CONVERGED" or r["true_relative_residual"] <= 1e-8
               for r in contrast)
    assert all(r["status"] == "CONVERGED" for r in ours), out
    assert all(r["true_relative_residual"] <= 1e-8 for r in ours)
    minres = {r["solver"]: r["iterations"] for r in results
              if r["problem"].startswith("saddle") and r["precond"] == "none"}
    assert abs(minres["minres"] - minres["scipy minres"]) <= 2


def test_benchmark_peers_then_multigrid_small(tmp_path):
    """The peers benchmark, then the multigrid one, in one test so that they
    never run side by side: beside the multigrid script's compiles (both
    cores), the peers script's 8-device CPU collectives aborted with an XLA
    check failure in 3 of 4 parallel runs of this stage."""
    path = tmp_path / "peers.json"
    run("benchmark_peers.py", "--small", "--json", str(path))
    data = json.loads(path.read_text())
    solvers = {r["solver"] for r in data["problems"]}
    assert {"solvax pcg", "jax.scipy cg", "solvax gmres one_sync"} <= solvers
    assert all(r["true_relative_residual"] < 1e-7 for r in data["problems"]
               if r["solver"].startswith("solvax"))
    rows = {(r["problem"].split()[0], r["solver"]): r for r in data["problems"]}
    # the same CG in exact arithmetic: the same matvecs (up to the true residual's)
    assert abs(rows["Poisson", "solvax pcg"]["matvecs"]
               - rows["Poisson", "jax.scipy cg"]["matvecs"]) <= 2
    # compile times relative to jax.scipy's solver of the same method on the same problem
    reference = {"Poisson": "jax.scipy cg", "convection-diffusion": "jax.scipy gmres batched",
                 "saddle-point": "jax.scipy gmres batched"}
    for (problem, _), r in rows.items():
        base = rows[problem, reference[problem]]["compile_s"]
        assert r["compile_vs_jax_scipy"] == pytest.approx(r["compile_s"] / base, rel=1e-12)
    # the synchronizations per iteration, read from the compiled programs
    syncs = {r["solver"]: r["all_reduces_per_iteration"] for r in data["latency"]}
    assert syncs == {"solvax pcg": 2, "solvax pcg single_reduction": 1,
                     "solvax pcg pipelined": 1, "solvax pcg s_step s=4": 0.25,
                     "jax.scipy cg": 2, "solvax bicgstab": 2, "solvax bicgstab one_sync": 1,
                     # executed: jax.scipy's 4 instructions, two of them tuples of 2
                     "jax.scipy bicgstab": 6 if sx._core.reduce.MERGES_ALL_REDUCES else 4,
                     "floor: 1 all-reduce, nothing else": 1,
                     "floor: 2 all-reduces, nothing else": 2}, syncs
    # multigrid on 8 devices: the coarsest grid gathered, or smoothed (no gather)
    coarse = {r["coarse"]: r for r in data["multigrid_mesh"]}
    assert coarse["direct"]["per_step"]["all-gather"] == 1
    assert "all-gather" not in coarse["chebyshev"]["per_step"]
    assert coarse["direct"]["per_step"]["all-reduce"] == coarse["chebyshev"]["per_step"][
        "all-reduce"] == 2
    assert abs(coarse["direct"]["iterations"] - coarse["chebyshev"]["iterations"]) <= 1
    base = {r["solver"]: r["ratio_to_jax_scipy"] for r in data["latency"]}
    assert base["jax.scipy cg"] == base["jax.scipy bicgstab"] == 1.0
    # the one-device BiCGStab sweep: every size and strength, both converged
    sweep = data["bicgstab_one_device"]
    assert {(r["n"], r["strength"]) for r in sweep} == {(n, c) for n in (16, 32)
                                                       for c in (10.0, 100.0, 1000.0)}
    for r in sweep:
        assert r["solvax_true_relative_residual"] <= 1e-8, r
        assert r["ratio"] == pytest.approx(r["solvax_s"] / r["jax_scipy_s"], rel=1e-12)
    # the nonlinear row: newton_krylov's defaults beside SciPy's
    (newton,) = data["newton"]
    assert newton["status"] == "CONVERGED" and newton["scipy"]["relative_residual"] <= 1e-10
    check_benchmark_multigrid_small(tmp_path)


def test_benchmark_recycling_small(tmp_path):
    path = tmp_path / "recycling.json"
    run("benchmark_recycling.py", "--small", "--json", str(path))
    data = json.loads(path.read_text())
    rows = data["sequence"]["rows"]
    assert set(rows) >= {"gmres(30)", "gcrot(30,10) cold", "gcrot(30,10) recycled"}
    for row in [*rows.values(), *data["symmetric"]["rows"].values()]:
        assert len(row["per_system"]) == data["sequence"]["steps"]
        assert row["matvecs"] == sum(row["per_system"]) > 0
    assert data["newton"]["inner_ratio"] == (data["newton"]["gcrot"]["inner"]
                                             / data["newton"]["bicgstab"]["inner"])
    (member,) = data["family"]  # the ledger's test bed, one tiny member
    assert member["recycled_vs_cold"] == member["recycled_matvecs"] / member["cold_matvecs"]
    assert member["gmres(30)_matvecs"] > 0 and member["recycled_matvecs"] > 0


def test_benchmark_newton_small(tmp_path):
    path = tmp_path / "newton.json"
    run("benchmark_newton.py", "--small", "--json", str(path))
    data = json.loads(path.read_text())
    (single,) = [row["float32_cycle"] for row in data["multigrid"] if "float32_cycle" in row]
    for row in data["multigrid"] + data["defaults"] + [single]:
        assert row["status"] == "CONVERGED" and row["relative_residual"] <= 1e-10, row
    for row in data["defaults"]:
        assert row["scipy"]["relative_residual"] <= 1e-10
        assert row["vs_scipy"] == pytest.approx(row["run_s"] / row["scipy"]["run_s"], rel=1e-12)
    for row in data["forcing"]:
        inner = [row[f]["inner"] for f in ("eisenstat_walker", "0.1", "0.01", "0.001")]
        assert row["default_vs_best"] == pytest.approx(inner[0] / min(inner), rel=1e-12)
    assert data["derivative"]["relative_error"] < 1e-6


def test_benchmark_tridiagonal_small(tmp_path):
    path = tmp_path / "tri.json"
    run("benchmark_tridiagonal.py", "--n", "4096", "--json", str(path))
    data = json.loads(path.read_text())
    assert data["collectives"]["total"] == 1
    assert data["thomas"]["relative_difference"] < 1e-12


def test_benchmark_structured_small(tmp_path):
    path = tmp_path / "structured.json"
    run("benchmark_structured.py", "--small", "--json", str(path))
    data = json.loads(path.read_text())
    assert [r["m"] for r in data["rows"]] == [1, 2, 4, 8, 16]
    assert all(r["error_vs_dense"] < 1e-12 for r in data["rows"])
    assert data["sharded_batch"]["collectives"] == 0
    assert data["partitioned"]["collectives"] == {"all-gather": 1}
    assert data["partitioned"]["relative_difference"] < 1e-12


def test_accelerator_small(tmp_path):
    """The chip's script on this CPU: its child process, rows and report; the
    structured solves against NumPy and the float32 floor cases run."""
    run("accelerator.py", "--small", "--out", str(tmp_path), "--only", "structured",
        "float32 floor")
    data = json.loads((tmp_path / "accelerator.json").read_text())
    rows = data["rows"]
    assert data["meta"]["backend"] == "cpu" and len(rows) == 18 + 11
    assert not [r for r in rows if r["verdict"].startswith(("ERROR", "CRASH", "not run"))]
    assert all(r["verdict"] == "ok" for r in rows if r["group"] == "structured direct solves")
    assert "cases ok" in (tmp_path / "cpu.md").read_text()


def test_accelerator_speed_small(tmp_path):
    """The chip's speed script on this CPU: every part runs, every solve
    takes the steps it was given, each ratio has its passes model beside it,
    and the report says which product pattern the rule picked."""
    run("accelerator_speed.py", "--small", "--out", str(tmp_path))
    data = json.loads((tmp_path / "accelerator_speed.json").read_text())
    assert data["meta"]["backend"] == "cpu" and data["triad"]["GB/s"] > 0
    steps = {r["method"]: r["steps"] for r in data["krylov"]}
    assert set(steps) >= {"pcg", "pcg single_reduction", "pcg pipelined", "jax.scipy cg",
                          "gmres(30)", "jax.scipy gmres(30)", "bicgstab", "jax.scipy bicgstab"}
    # float32 at these sizes may reach its floor before the 60 steps given
    assert all(20 <= r["steps"] <= 60 and r["passes"] > 0 and r["ratio"] > 0
               for r in data["krylov"])
    # kernels per step read from each compiled step loop, the vector ones among them
    assert all(0 < r["kernels"]["vector"] <= r["kernels"]["kernels"] for r in data["krylov"]
               if not r["method"].startswith("jax.scipy gmres"))
    tolerance = {r["method"]: r for r in data["tolerance"]}
    assert set(tolerance) == {"pcg", "pcg single_reduction", "pcg pipelined", "jax.scipy cg",
                              "bicgstab", "bicgstab one_sync", "jax.scipy bicgstab"}
    assert all(r["status"] in ("CONVERGED", "FLOOR", "STAGNATION") and r["true_residual"] < 1e-3
               for name, r in tolerance.items() if not name.startswith("jax.scipy"))
    assert {r["case"] for r in data["multigrid"]} == {"MG-CG 2-D 32^2 V", "MG-CG 3-D 8^3 V"}
    assert all(r["status"] == "CONVERGED" and r["levels"] >= 2 for r in data["multigrid"])
    matvecs = {r["method"]: r["matvecs"] for r in data["recycling"]}
    assert set(matvecs) == {"gmres(30)", "gcrot cold", "gcrot recycled"}
    # target 4's part: float64 answers from float32 corrections, checked on the host
    precision = {r["case"].split(" ", 2)[2]: r for r in data["precision"] if "64^2" in r["case"]}
    assert precision["float32 MG-CG to its floor"]["true_residual"] > 1e-9
    assert all(precision[name]["status"] == "CONVERGED" and precision[name]["true_residual"]
               < 1e-10 for name in ("refinement, float32 MG-CG corrections", "float64 MG-CG"))
    assert "passes at triad" in (tmp_path / "cpu_speed.md").read_text()


def test_accelerator_speed_picks_cases_and_times_a_fresh_first_call(tmp_path):
    """`--cases` keeps the multigrid cases its texts name, and `--fresh` times
    each one's first call again in a process of its own."""
    run("accelerator_speed.py", "--small", "--only", "multigrid", "--cases", "2-D",
        "--fresh", "--out", str(tmp_path))
    data = json.loads((tmp_path / "accelerator_speed.json").read_text())
    (row,) = data["multigrid"]
    assert row["case"] == "MG-CG 2-D 32^2 V" and row["status"] == "CONVERGED"
    assert row["first_s"] > 0 and row["first_fresh_s"] > 0
    assert "fresh)" in (tmp_path / "cpu_speed.md").read_text()


def test_device_profile_and_compile_probe_small(tmp_path):
    """The chip's profiling scripts on this CPU: each profiled case reports
    its kernels' time and launches per call and by named scope, writes the
    optimized HLO it was asked for, and the compile probe times each program
    it names."""
    env = dict(os.environ, PROFILE_HLO="vcycle")
    done = subprocess.run([sys.executable, str(BENCH / "device_profile.py"), "--small",
                           "--only", "vcycle", "pcg_standard", "precision_refinement",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    heads = [line.split() for line in done.stdout.splitlines() if line.startswith("## ")]
    assert [h[1] for h in heads] == ["vcycle_32:", "pcg_standard_32:",
                                     "precision_refinement_32:"]
    scopes = done.stdout.split("## precision_refinement_32:")[1]
    assert "by named scope:" in scopes and "solvax.refinement.inner" in scopes
    # "## name: T us of device kernels per call, L launches, W us wall (...)"
    assert all(float(h[2]) > 0 and int(h[9]) > 0 and float(h[11]) > 0 for h in heads)
    assert [p.name for p in tmp_path.iterdir()] == ["vcycle_32.hlo.txt"]
    out = run("probe_refinement_compile.py", "32", "resid64", "ref_mg_whole")
    assert [line.split()[0] for line in out.splitlines()] == ["resid64", "ref_mg_whole"]
    run("probe_gmres_rows.py", "32", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "gmres_rows.json").read_text())["32"]
    assert set(rows) == {"one_sync every row", "one_sync rows in use", "cgs2 every row",
                         "cgs2 rows in use", "one_sync rows in use, one reduce", "jax.scipy"}
    assert all(r["ms_per_matvec"] > 0 and r["copied_slices"] >= 0 for r in rows.values())
    assert rows["jax.scipy"]["ratio"] == 1.0


def test_multigrid_forms_probe_small(tmp_path):
    """The chip's multigrid-forms probe on this CPU, at the smallest grid
    where every form differs from the library's (128^2: a `Tail` from 1/4):
    the same iterations, a first call, warm times and kernels counted."""
    run("probe_multigrid_forms.py", "128", "--forms", "library", "strided, tail 1/4",
        "--out", str(tmp_path))
    rows = json.loads((tmp_path / "multigrid_forms.json").read_text())["128"]
    assert set(rows) == {"library", "strided, tail 1/4"}
    assert rows["library"]["iterations"] == rows["strided, tail 1/4"]["iterations"]
    assert all(r["status"] == "CONVERGED" and r["first_s"] > 0 and r["solve_ms"] > 0
               and r["cycle_ms"] > 0 and r["cycle_kernels"] > 0 for r in rows.values())


def test_plot_results_draws_every_figure_from_the_saved_results(tmp_path):
    out = run("plot_results.py", "--out", str(tmp_path))
    names = ["convergence_preconditioners.png", "convergence_variants.png",
             "convergence_sstep.png", "latency.png", "recycling.png"]
    assert all((tmp_path / name).stat().st_size > 10_000 for name in names), out


def test_fit_latency_small(tmp_path):
    """The scaling model's fit, recomputed from the times it saved: alpha is
    the least-squares slope through the origin of the scalar all-reduce times
    against ceil(log2 P), beta the (non-negative) slope of the vector
    all-reduce times against their bytes, and every modelled and projected
    time is the model's formula; the synchronizations per iteration are read
    from the compiled programs."""
    path = tmp_path / "scaling.json"
    run("fit_latency.py", "--small", "--json", str(path), "--plot", str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").stat().st_size > 10_000
    data = json.loads(path.read_text())
    syncs = {row["method"]: row["syncs"] for row in data["methods"]}
    assert syncs["pcg standard"] == 2 and syncs["pcg single_reduction"] == 1
    assert syncs["pcg s_step s=4"] == 0.25 and syncs["bicgstab one_sync"] == 1
    assert data["devices"] == 8 and sorted(map(int, data["allreduce_s"])) == [1, 2, 4, 8]
    levels = {int(p): math.ceil(math.log2(int(p))) for p in data["allreduce_s"]}
    times = {int(p): t for p, t in data["allreduce_s"].items()}
    alpha = sum(times[p] * levels[p] for p in times) / sum(v * v for v in levels.values())
    assert data["alpha_s"] == pytest.approx(alpha, rel=1e-9)
    by_bytes = {int(k): v for k, v in data["allreduce_s_by_bytes"].items()}
    slope = np.polyfit(list(by_bytes), list(by_bytes.values()), 1)[0]
    assert data["beta_s_per_byte"] == pytest.approx(max(slope, 0.0), rel=1e-6, abs=1e-18)
    alpha, beta = data["alpha_s"], data["beta_s_per_byte"]
    for row in data["methods"]:
        def model(p, shared=1.0, row=row):
            return (shared * row["local_s"] + row["syncs"] * alpha * math.ceil(math.log2(p))
                    + row["bytes"] * beta)
        assert row["model_s"] == pytest.approx(model(8, data["shared"]), rel=1e-9)
        assert {int(p): t for p, t in row["projection_s"].items()} == pytest.approx(
            {p: model(p) for p in (1, 8, 64, 512, 4096, 10_000)}, rel=1e-9)


def check_benchmark_multigrid_small(tmp_path):
    """Run after the peers benchmark in its test (see there)."""
    path = tmp_path / "mg.json"
    run("benchmark_multigrid.py", "--small", "--json", str(path))
    data = json.loads(path.read_text())
    for row in data["sizes"]:
        for key in ("jacobi", "chebyshev"):
            assert row[key]["status"] == "CONVERGED" and row[key]["residual"] < 1e-8
        assert row["pyamg_rs"]["residual"] < 1e-8
    assert all(r["status"] == "CONVERGED" for r in data["coefficients"] + data["nonsymmetric"])
    for row in data["blocks"]:
        assert all(row[name]["status"] == "CONVERGED" for name in ("default", "plain")), row
    for row in data["shifted"]:
        assert row["default_iterations"] > 0 and row["plain_iterations"] > 0, row
        # the plain configuration chosen: detected as the same hierarchy (and
        # then timed once, its numbers copied)
        assert row["same_hierarchy"] == (row["default_coarse"] == "direct"), row
        if row["default_coarse"] == "direct":
            assert row["default_iterations"] == row["plain_iterations"], row
    assert all(r["krylov_converged"] and r["alone_converged"] for r in data["cycles"])
    timing = data["time"]
    assert timing["mg_residual"] < 1e-8 and timing["mg_iterations"] < timing["cg_iterations"]
    assert timing["mg_f32_cycle_residual"] < 1e-8
    assert timing["mg_f32_cycle_iterations"] <= timing["mg_iterations"] + 1
    assert timing["mg_closed_iterations"] == timing["mg_given_iterations"]
    assert abs(timing["mg_given_iterations"] - timing["mg_iterations"]) <= 1


def test_benchmark_precision_small(tmp_path):
    path = tmp_path / "precision.json"
    run("benchmark_precision.py", "--small", "--json", str(path))
    data = json.loads(path.read_text())
    for row in data["poisson"]["rows"].values():
        assert row["status"] == "CONVERGED" and row["true_relative_residual"] <= 1e-12, row
    storage = data["storage"]["rows"]
    for row in storage.values():
        assert row["status"] == "CONVERGED" and row["true_relative_residual"] <= 1e-8, row
    assert abs(storage["bfloat16"]["iterations"] - storage["float32"]["iterations"]) <= 1
    assert all(row["built_once_s"] > 0 for row in storage.values())
    for row in data["kappa"]:
        # converged exactly where the inner precision resolves the system
        assert (row["status"] == "CONVERGED") == row["resolvable"], row


def test_gpu_lane_small(tmp_path):
    """The GPU lane's plumbing on this CPU at tiny sizes: the trust part in
    its own process, the speed part for k = 1 and 8 (`SOLVAX_STEPS_PER_TEST`)
    and the multigrid part, each result written, the table printed last."""
    out = run("gpu_lane.py", "--small", "--out", str(tmp_path), "--budget", "500",
              "--workers", "1")
    data = json.loads((tmp_path / "gpu_lane.json").read_text())
    assert data["meta"]["backend"] == "cpu" and set(data) >= {"trust", "speed", "multigrid"}
    trust = data["trust"]["structured"]
    assert trust["cases"] > 0 and not trust["bad"], trust
    for label in ("k=1", "k=8"):
        rows = data["speed"][label]["result"]["krylov"]
        assert {r["method"] for r in rows} >= {"pcg", "jax.scipy cg"}, label
    assert data["multigrid"]["returncode"] == 0
    assert "# GPU lane" in out and (tmp_path / "gpu.md").read_text().startswith("# GPU lane")
