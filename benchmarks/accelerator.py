"""Every solver, structured solve and preconditioner on the current backend (a TPU chip).

`python benchmarks/accelerator.py [--small] [--out DIR] [--only TEXT ...] [--budget S]`

Runs, each in float32 and float64 (x64 on):
  * every Krylov method x {no preconditioner, Jacobi, multigrid} on a 2-D
    diffusion problem (spacing 1/n) and, for the methods that take
    nonsymmetric operators, an upwind convection-diffusion problem;
  * the float32 floor cases of issue 48 (diffusion, rtol 1e-5, below what
    float32 attains at 128^2): the status must name a precision floor
    (FLOOR / STAGNATION / MAX_STEPS), never INDEFINITE / NONFINITE / BREAKDOWN, and
    the returned x is never worse than x0 = 0;
  * every structured direct solve against a dense NumPy solve;
  * the other preconditioners and multigrid variants (block Jacobi,
    Chebyshev with `estimate_spectrum`, mixed precision, W/F cycles, line
    coarse solves, `multigrid_solve`);
  * one gradient per method against a central finite difference (float64).

Every verdict comes from an independent true residual in float64 NumPy. Each
row records the first call (trace + compile + run) and a warm call. Writes
`accelerator.json` and `tpu.md` (or `cpu.md`) under `--out` after every case,
so a run cut short keeps what it measured. Runs on the CPU at tiny sizes
(`--small`), which CI's benchmark smoke test does.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import time
import traceback

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from problems import cell_relative_residual, cell_stencil  # noqa: E402

import solvax as sx  # noqa: E402

GOOD_FLOOR = ("FLOOR", "STAGNATION", "MAX_STEPS")  # a precision floor, named as such


# ------------------------------------------------------------------ problems
def operator(n: int, convection: float, dtype):
    if convection == 0.0:
        return sx.diffusion_operator(jnp.ones((n, n), dtype), spacing=1.0 / n)
    entries = {o: jnp.broadcast_to(jnp.asarray(v, dtype), (n, n))
               for o, v in cell_stencil(n, convection).items()}
    return sx.stencil_operator(entries)


# ------------------------------------------------------------------- solvers
def _refinement(inner):
    return functools.partial(sx.iterative_refinement, solver=inner)


SYMMETRIC = {  # SPD operators only
    "pcg": sx.pcg,
    "pcg single_reduction": functools.partial(sx.pcg, single_reduction=True),
    "pcg pipelined": functools.partial(sx.pcg, method="pipelined"),
    "pcg s_step(4)": functools.partial(sx.pcg, method="s_step", s=4),
    "minres": sx.minres,
}
GENERAL = {
    "gmres(30)": sx.gmres,
    "gmres(30) cgs2": functools.partial(sx.gmres, orthogonalization="cgs2"),
    "gcrot(30,10)": sx.gcrot,
    "bicgstab": sx.bicgstab,
    "bicgstab one_sync": functools.partial(sx.bicgstab, method="one_sync"),
    "idrs(4)": sx.idrs,
}
# float64 answers from float32 corrections (float64 only)
REFINEMENT = {
    "iterative_refinement(pcg)": _refinement(sx.pcg),
    "iterative_refinement(gmres)": _refinement(sx.gmres),
}


def preconditioner(name, A):
    if name == "none":
        return None
    if name == "jacobi":
        return sx.jacobi(A.diagonal())
    if name == "multigrid":
        return sx.multigrid(A)
    raise ValueError(name)


# -------------------------------------------------------------------- runner
class Runner:
    """Collects the cases (`case`), then runs them in a child process that
    appends one JSON line per finished case; a child that dies (a compiler
    abort is a process abort) leaves a CRASH row and a new child goes on
    from the next case. The parent never starts a backend: one process at a
    time holds a TPU."""

    def __init__(self, args):
        self.args = args
        self.cases = []

    def case(self, group, name, run):
        """A case: `run()` -> dict (its verdict and numbers)."""
        if any(text in f"{group} {name}" for text in self.args.only):
            self.cases.append(({"group": group, "case": name}, run))

    def child(self):
        """Run cases from `--start` on, one JSON line each into `--rows`; the
        run's facts and the case under way into `--rows`.meta."""
        device = jax.devices()[0]
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "backend": jax.default_backend(),
            "device": f"{device.platform}: {getattr(device, 'device_kind', '?')}",
            "devices": jax.device_count(),
            "jax": jax.__version__,
            "solvax": sx.__version__,
        }
        for i, (row, run) in enumerate(self.cases):
            if i < self.args.start:
                continue
            with open(self.args.rows + ".meta", "w") as f:
                json.dump({"meta": meta, "total": len(self.cases), "current": row}, f)
            row = dict(row)
            if time.time() > self.args.deadline:
                row.update(verdict="not run (budget)")
            else:
                try:
                    row.update(run())
                except Exception as e:  # noqa: BLE001 - a row per failure, the run goes on
                    msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    row.update(verdict="ERROR", error=msg)
                    traceback.print_exc()
            print(json.dumps(row), flush=True)
            with open(self.args.rows, "a") as f:
                f.write(json.dumps(row) + "\n")

    def parent(self):
        import subprocess
        import sys
        import tempfile

        deadline = time.time() + self.args.budget
        rows_path = os.path.join(tempfile.mkdtemp(), "rows.jsonl")
        rows, total, meta = [], None, {}
        while total is None or len(rows) < total:
            command = [sys.executable, __file__, *sys.argv[1:], "--start", str(len(rows)),
                       "--deadline", str(deadline), "--rows", rows_path]
            code = subprocess.call(command)
            if not os.path.exists(rows_path + ".meta"):
                raise SystemExit(f"the first child failed before its first case (exit {code})")
            with open(rows_path + ".meta") as f:
                state = json.load(f)
            meta, total = state["meta"], state["total"]
            if os.path.exists(rows_path):
                with open(rows_path) as f:
                    rows = [json.loads(line) for line in f if line.strip()]
            if code != 0 and len(rows) < total:
                crashed = dict(state["current"])
                crashed.update(verdict=f"CRASH: the process died (exit code {code})")
                with open(rows_path, "a") as f:
                    f.write(json.dumps(crashed) + "\n")
                rows.append(crashed)
            self.write(meta, rows)
        return rows

    def write(self, meta, rows):
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, "accelerator.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        name = "tpu.md" if meta["backend"] == "tpu" else f"{meta['backend']}.md"
        with open(os.path.join(self.args.out, name), "w") as f:
            f.write(markdown(meta, rows))


def timed(f, *args):
    """(first call seconds, warm call seconds, result)."""
    t = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    first = time.perf_counter() - t
    t = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    return first, time.perf_counter() - t, out


def krylov_row(n, convection, solve, dtype, rtol, precond_name, expect_converged):
    A = operator(n, convection, dtype)
    b = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)

    @jax.jit
    def run(b):
        return solve(A, b, rtol=rtol, precond=preconditioner(precond_name, A))

    first, warm, sol = timed(run, b)
    res = cell_relative_residual(n, convection, sol.x, b)
    status = sx.Status(int(sol.status)).name
    ok_converged = bool(sol.converged) and res <= 3 * rtol
    if bool(sol.converged):
        verdict = "ok" if ok_converged else "WRONG: converged flag, residual above rtol"
    elif expect_converged:
        verdict = f"FAIL: {status}"
    elif status in GOOD_FLOOR and res <= 1.0:
        verdict = "ok (floor named)"
    else:
        verdict = f"FAIL: {status} at {res:.2g}"
    return {"dtype": jnp.dtype(dtype).name, "precond": precond_name, "rtol": rtol,
            "status": status, "iterations": int(sol.iterations), "true_residual": res,
            "first_s": round(first, 3), "warm_s": round(warm, 5), "verdict": verdict}


def gradient_row(n, solve, dtype):
    """d/dtheta of w . x(theta), A(theta) = diffusion with k = 1 + theta * field,
    against a central difference."""
    field = jnp.asarray(np.cos(np.linspace(0, 3, n))[:, None] * np.ones((1, n)), dtype)
    b = jnp.asarray(np.random.default_rng(1).standard_normal((n, n)), dtype)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((n, n)), dtype)
    rtol = 1e-11 if dtype == jnp.float64 else 1e-5

    def loss(theta):
        A = sx.diffusion_operator(1.0 + theta * field, spacing=1.0 / n)
        return jnp.vdot(w, solve(A, b, rtol=rtol).x)

    theta = jnp.asarray(0.3, dtype)
    grad = jax.jit(jax.grad(loss))
    first, warm, g = timed(grad, theta)
    h = 1e-4 if dtype == jnp.float64 else 1e-2
    fd = (float(jax.jit(loss)(theta + h)) - float(jax.jit(loss)(theta - h))) / (2 * h)
    err = abs(float(g) - fd) / max(abs(fd), 1e-30)
    limit = 1e-5 if dtype == jnp.float64 else 5e-2
    return {"dtype": jnp.dtype(dtype).name, "grad": float(g), "finite_difference": fd,
            "relative_error": err, "first_s": round(first, 3), "warm_s": round(warm, 5),
            "verdict": "ok" if np.isfinite(err) and err <= limit else f"FAIL: error {err:.2g}"}


# ---------------------------------------------------------- structured solves
def dense_tridiagonal(l, d, u, cyclic):
    """Bands `(n,)` as 1 x 1 blocks (`lower[0]`, `upper[-1]`: the corners)."""
    return dense_block_tridiagonal(*(np.reshape(a, (-1, 1, 1)) for a in (l, d, u)), cyclic)


def dense_block_tridiagonal(L, D, U, cyclic):
    """Blocks `(n, m, m)`; with `cyclic`, `L[0]` and `U[-1]` wrap around."""
    n, m = D.shape[0], D.shape[1]
    A = np.zeros((n * m, n * m))
    for i in range(n):
        A[i * m:(i + 1) * m, i * m:(i + 1) * m] = D[i]
        if i > 0 or cyclic:
            j = (i - 1) % n
            A[i * m:(i + 1) * m, j * m:(j + 1) * m] = L[i]
        if i < n - 1 or cyclic:
            j = (i + 1) % n
            A[i * m:(i + 1) * m, j * m:(j + 1) * m] = U[i]
    return A


def structured_cases(n):
    """(name, function of dtype -> (x, A_dense, rhs_dense))."""
    rng = np.random.default_rng(3)
    l, u = rng.uniform(-1, 1, n), rng.uniform(-1, 1, n)
    d = 3.0 + rng.uniform(0, 1, n)
    rhs = rng.standard_normal(n)
    m = 4
    L, U = rng.uniform(-0.5, 0.5, (2, n // m, m, m))
    D = rng.uniform(-0.5, 0.5, (n // m, m, m)) + 4 * np.eye(m)
    bands = rng.uniform(-1, 1, (6, n))
    bands[3] = 6.0 + rng.uniform(0, 1, n)  # the diagonal: row u = 3 (l = 2, u = 3)
    mesh = functools.partial(jax.sharding.Mesh, axis_names=("i",))  # a backend only when run

    def arrays(dtype, *xs):
        return [jnp.asarray(x, dtype) for x in xs]

    def tri(cyclic):
        def f(dtype):
            fn = sx.cyclic_tridiagonal_solve if cyclic else sx.tridiagonal_solve
            return jax.jit(fn)(*arrays(dtype, l, d, u, rhs)), dense_tridiagonal(l, d, u, cyclic)
        return f

    def block(cyclic):
        def f(dtype):
            fn = sx.cyclic_block_tridiagonal_solve if cyclic else sx.block_tridiagonal_solve
            x = jax.jit(fn)(*arrays(dtype, L, D, U, rhs.reshape(n // m, m)))
            return x.reshape(-1), dense_block_tridiagonal(L, D, U, cyclic)
        return f

    def factored(dtype):
        fac = jax.jit(sx.block_tridiagonal_factor)(*arrays(dtype, L, D, U))
        x = jax.jit(sx.block_tridiagonal_solve_factored)(fac, *arrays(dtype, rhs.reshape(-1, m)))
        return x.reshape(-1), dense_block_tridiagonal(L, D, U, False)

    def banded(periodic):
        def f(dtype):
            x = jax.jit(functools.partial(sx.banded_solve, lower_bandwidth=2, upper_bandwidth=3,
                                          periodic=periodic))(*arrays(dtype, bands, rhs))
            A = np.zeros((n, n))
            for k in range(-2, 4):  # A[i, i + k] = bands[3 - k, i + k]
                for i in range(n):
                    j = i + k
                    if periodic or 0 <= j < n:
                        A[i, j % n] = bands[3 - k, j % n]
            return x, A
        return f

    def partitioned(dtype):
        x = jax.jit(functools.partial(sx.partitioned_tridiagonal_solve, axis_name="i",
                                      mesh=mesh(np.array(jax.devices()[:1]))))(
            *arrays(dtype, l, d, u, rhs))
        return x, dense_tridiagonal(l, d, u, False)

    def partitioned_block(dtype):
        x = jax.jit(functools.partial(sx.partitioned_block_tridiagonal_solve, axis_name="i",
                                      mesh=mesh(np.array(jax.devices()[:1]))))(
            *arrays(dtype, L, D, U, rhs.reshape(-1, m)))
        return x.reshape(-1), dense_block_tridiagonal(L, D, U, False)

    return rhs, [
        ("tridiagonal_solve", tri(False)), ("cyclic_tridiagonal_solve", tri(True)),
        ("block_tridiagonal_solve", block(False)), ("cyclic_block_tridiagonal_solve", block(True)),
        ("block_tridiagonal_factor + solve_factored", factored),
        ("banded_solve (2, 3)", banded(False)), ("banded_solve (2, 3) periodic", banded(True)),
        ("partitioned_tridiagonal_solve (1 device)", partitioned),
        ("partitioned_block_tridiagonal_solve (1 device)", partitioned_block),
    ]


def structured_row(f, rhs, dtype):
    t = time.perf_counter()
    x, A = f(dtype)
    x = np.asarray(jax.block_until_ready(x), np.float64)
    first = time.perf_counter() - t
    exact = np.linalg.solve(A, rhs)
    err = float(np.linalg.norm(x - exact) / np.linalg.norm(exact))
    limit = 1e-11 if dtype == jnp.float64 else 1e-4
    return {"dtype": jnp.dtype(dtype).name, "error_vs_numpy": err, "first_s": round(first, 3),
            "verdict": "ok" if err <= limit else f"FAIL: error {err:.2g}"}


def other_preconditioners(n):
    """(name, solve(A, b, rtol, precond=None) -> Solution, convection)."""

    def block_jacobi(A, b, rtol, precond=None):
        # blocks of 4 consecutive rows along axis 0: the operator's own
        # tridiagonal coupling there (diagonal 4/h^2, neighbours -1/h^2)
        m, h2 = 4, n * n
        eye = functools.partial(jnp.eye, m, dtype=b.dtype)
        block = 5.0 * h2 * eye() - h2 * (eye(k=1) + eye(k=-1))
        return sx.pcg(A, b, rtol=rtol,
                      precond=sx.block_jacobi(jnp.broadcast_to(block, (n // m, m, m))))

    def chebyshev(A, b, rtol, precond=None):
        lmin, lmax = sx.estimate_spectrum(A, jnp.ones_like(b))
        return sx.pcg(A, b, rtol=rtol, precond=sx.chebyshev(A, lmin, lmax, degree=4))

    def mixed(A, b, rtol, precond=None):
        return sx.pcg(A, b, rtol=rtol, precond=sx.mixed_precision(sx.multigrid(A)))

    def cycle(name, solver=sx.pcg, **options):
        def f(A, b, rtol, precond=None):
            return solver(A, b, rtol=rtol, precond=sx.multigrid(A, cycle=name, **options))
        return f

    def mg_solve(A, b, rtol, precond=None):
        return sx.multigrid_solve(A, b, rtol=rtol)

    return [
        ("pcg + block_jacobi(4)", block_jacobi, 0.0),
        ("pcg + chebyshev(estimate_spectrum)", chebyshev, 0.0),
        ("pcg + mixed_precision(multigrid)", mixed, 0.0),
        ("pcg + multigrid W", cycle("W"), 0.0),
        ("gmres + multigrid F", cycle("F", sx.gmres), 0.0),
        ("pcg + multigrid chebyshev smoother", cycle("V", smoother="chebyshev"), 0.0),
        ("pcg + multigrid coarse=lines, full interpolation",
         cycle("V", coarse="lines", interpolation="full"), 0.0),
        ("pcg + multigrid coarse=chebyshev", cycle("V", coarse="chebyshev"), 0.0),
        ("multigrid_solve", mg_solve, 0.0),
        ("bicgstab + multigrid (convection)", cycle("V", sx.bicgstab), 10.0),
    ]


# ------------------------------------------------------------------ markdown
def markdown(meta, rows):
    lines = [
        "# solvax on an accelerator (`benchmarks/accelerator.py`)",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']} ({meta['devices']} device(s)), backend {meta['backend']}",
        f"- JAX {meta['jax']}, solvax {meta['solvax']}",
        "- true residuals and errors: float64 NumPy, independent of the solve;"
        " `first s`: trace + compile + run; `warm s`: a second call",
        "",
    ]
    bad = [r for r in rows if not str(r.get("verdict", "")).startswith("ok")]
    lines += [f"**{len(rows) - len(bad)} of {len(rows)} cases ok.**", ""]
    groups = []
    for r in rows:
        if r["group"] not in groups:
            groups.append(r["group"])
    for g in groups:
        part = [r for r in rows if r["group"] == g]
        lines += [f"## {g}", ""]
        keys = [k for k in ("case", "dtype", "precond", "rtol", "status", "iterations",
                            "true_residual", "error_vs_numpy", "grad", "finite_difference",
                            "relative_error", "first_s", "warm_s", "verdict", "error")
                if any(k in r for r in part)]
        lines += ["| " + " | ".join(k.replace("_", " ") for k in keys) + " |",
                  "|" + "---|" * len(keys)]
        for r in part:
            lines.append("| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |")
        lines.append("")
    return "\n".join(lines)


def cell(v):
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v).replace("|", "/")


# ---------------------------------------------------------------------- main
def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny problems (CPU smoke test)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--only", nargs="+", default=[""], metavar="TEXT",
                   help="only cases whose group + name contain one of these")
    p.add_argument("--budget", type=float, default=450.0,
                   help="seconds after which no new case starts (rows say 'not run')")
    p.add_argument("--start", type=int, default=-1, help=argparse.SUPPRESS)  # a child's
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--rows", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    started = time.perf_counter()
    n = 16 if args.small else 128
    runner = Runner(args)
    dtypes = (jnp.float64, jnp.float32)
    rtols = {jnp.float32: 1e-4, jnp.float64: 1e-10}
    preconds = ("none", "jacobi", "multigrid")

    for dtype in dtypes:
        for precond in preconds:
            for problem, convection, methods in (("diffusion", 0.0, {**SYMMETRIC, **GENERAL}),
                                                 ("convection", 10.0, GENERAL)):
                group = f"Krylov, {problem} {n}^2"
                for name, solve in methods.items():
                    runner.case(group, name, functools.partial(
                        krylov_row, n, convection, solve, dtype, rtols[dtype], precond, True))
        if dtype == jnp.float64:
            rhs, cases = structured_cases(48 if args.small else 240)
            for dt in dtypes:
                for name, f in cases:
                    runner.case("structured direct solves", name,
                                functools.partial(structured_row, f, rhs, dt))
    for name, solve in {**SYMMETRIC, **GENERAL}.items():
        runner.case(f"float32 floor: diffusion {n}^2, rtol 1e-5, no preconditioner", name,
                    functools.partial(krylov_row, n, 0.0, solve, jnp.float32, 1e-5, "none",
                                      False))
    for precond in preconds:
        for problem, convection, inner in (("diffusion", 0.0, "pcg"),
                                           ("convection", 10.0, "gmres")):
            name = f"iterative_refinement({inner})"
            runner.case(f"float64 from float32 corrections, {problem} {n}^2", name,
                        functools.partial(krylov_row, n, convection, REFINEMENT[name],
                                          jnp.float64, 1e-10, precond, True))
    for dtype in dtypes:
        for name, solve, convection in other_preconditioners(n):
            runner.case("other preconditioners and multigrid variants", name, functools.partial(
                krylov_row, n, convection, solve, dtype, rtols[dtype], "none", True))
    for name, solve in {**SYMMETRIC, **GENERAL, **REFINEMENT}.items():
        for dtype in dtypes if "refinement" not in name else (jnp.float64,):
            runner.case("gradients (d/dtheta, k = 1 + theta f) against finite differences",
                        name, functools.partial(gradient_row, n, solve, dtype))
    if args.start >= 0:
        runner.child()
        return
    rows = runner.parent()
    bad = [r for r in rows if not str(r.get("verdict", "")).startswith("ok")]
    print(f"{len(rows) - len(bad)} of {len(rows)} ok; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
