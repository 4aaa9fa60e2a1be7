"""Newton–Krylov (`sx.newton_krylov`) beside SciPy's `newton_krylov`.

    python benchmarks/benchmark_newton.py [--json PATH] [--small] [--only TEXT]

One device, float64. Every solve runs from `u = 0` to `||F(u)|| <= 1e-10
||F(0)||` (2-norms, checked on the returned `u`). Problems (`problems.py`):
2-D Bratu `-Δu - λ e^u = 0` (λ = 6, and 6.7 near the turning point 6.81)
and the nonsymmetric `-div((1 + u^2) grad u) + 20 ∂u/∂x = 100`, whose full
Newton step from 0 overshoots. Parts (`--only`):

- `multigrid`: BiCGStab preconditioned by `sx.multigrid` of the Jacobian
  `-Δ - λ e^u`, rebuilt at every Newton step (`precond_builder`), at 128^2,
  256^2 and 512^2: Newton steps, inner iterations, time (warm) and compile
  time; at 256^2 against SciPy's defaults in the same run.
- `defaults`: `sx.newton_krylov` with its defaults (no preconditioner)
  against SciPy's `newton_krylov` with its defaults (LGMRES inner solves,
  Armijo line search) on every problem at 128^2 and Bratu at 256^2.
- `forcing`: total inner iterations with Eisenstat–Walker (the default) and
  fixed forcing terms 0.1, 1e-2, 1e-3, without and with the preconditioner.
- `derivative`: d/dλ of the mean of the Bratu root by `jax.grad` (implicit
  function theorem) against a central difference of two solves.

`--small` runs every part on 16^2 grids (a smoke test).
"""

import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from problems import (  # noqa: E402
    bratu,
    bratu_multigrid,
    median_time,
    nonlinear_convection,
    parse_args,
    run_parts,
)

import solvax as sx  # noqa: E402

RTOL = 1e-10
FORCINGS = ("eisenstat_walker", 0.1, 1e-2, 1e-3)


def problem(name, n):
    """`(F in JAX, F in NumPy, precond_builder or None)`."""
    if name.startswith("bratu"):
        lam = float(name.split()[1])
        return bratu(n, lam), bratu(n, lam, xp=np), bratu_multigrid(n, lam)
    return nonlinear_convection(n), nonlinear_convection(n, xp=np), None


def solvax_run(F, n, repeats, **options):
    """Steps, inner iterations, relative ||F||, warm time and compile time."""
    u0 = jnp.zeros((n, n))
    fn = lambda u0: sx.newton_krylov(F, u0, rtol=RTOL, **options)  # noqa: E731
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(u0).compile()
    compile_s = time.perf_counter() - start
    sol = compiled(u0)
    return dict(status=sx.Status(int(sol.status)).name, steps=int(sol.iterations),
                inner=int(sol.linear_iterations),
                relative_residual=float(jnp.linalg.norm(F(sol.u)) / jnp.linalg.norm(F(u0))),
                run_s=median_time(fn, u0, repeats=repeats), compile_s=compile_s)


def scipy_run(F, n, repeats):
    """SciPy's `newton_krylov` with its defaults, to the same 2-norm tolerance."""
    from scipy.optimize import newton_krylov

    u0 = np.zeros((n, n))
    f0 = np.linalg.norm(F(u0))
    times, steps = [], []
    for _ in range(repeats):
        steps.append(0)
        start = time.perf_counter()
        u = newton_krylov(F, u0, f_tol=RTOL * f0, tol_norm=np.linalg.norm, maxiter=1000,
                          callback=lambda x, f: steps.__setitem__(-1, steps[-1] + 1))
        times.append(time.perf_counter() - start)
    return dict(steps=steps[0], run_s=float(np.median(times)),
                relative_residual=float(np.linalg.norm(F(u)) / f0))


def multigrid(small):
    rows = []
    for n in ((16, 24) if small else (128, 256, 512)):
        F, F_np, builder = problem("bratu 6", n)
        row = dict(n=n, **solvax_run(F, n, 11, precond_builder=builder))
        row["inner_per_step"] = row["inner"] / max(row["steps"], 1)
        if n == (24 if small else 256):
            row["scipy"] = scipy_run(F_np, n, 1)
            row["vs_scipy"] = row["run_s"] / row["scipy"]["run_s"]
            # the same multigrid in float32 (`multigrid(..., dtype=jnp.float32)`)
            single = solvax_run(F, n, 11, precond_builder=bratu_multigrid(n, 6.0, jnp.float32))
            row["float32_cycle"] = dict(single, vs_scipy=single["run_s"] / row["scipy"]["run_s"])
        rows.append(row)
        print(f"multigrid Bratu {n}^2: {row['steps']} steps, {row['inner']} inner "
              f"({row['inner_per_step']:.1f}/step), {row['run_s']:.3f} s, compile "
              f"{row['compile_s']:.1f} s" + (f"; SciPy {row['scipy']['run_s']:.2f} s "
                                              f"({row['scipy']['steps']} steps): "
                                              f"{row['vs_scipy']:.3f}x" if "scipy" in row
                                              else ""), flush=True)
        if "float32_cycle" in row:
            single = row["float32_cycle"]
            print(f"  with a float32 cycle: {single['steps']} steps, {single['inner']} inner, "
                  f"{single['run_s']:.3f} s ({single['vs_scipy']:.3f}x SciPy), relative ||F|| "
                  f"{single['relative_residual']:.1e}", flush=True)
    return rows


def defaults(small, cases=None):
    """`cases`: `(problem, n)` pairs (default: every problem)."""
    cases = cases or ([("bratu 6", 16), ("bratu 6.7", 16), ("convection", 16)] if small else
                      [("bratu 6", 128), ("bratu 6.7", 128), ("convection", 128),
                       ("bratu 6", 256)])
    rows = []
    for name, n in cases:
        F, F_np, _ = problem(name, n)
        row = dict(problem=name, n=n, **solvax_run(F, n, 3))
        row["scipy"] = scipy_run(F_np, n, 1 if n > 128 else 3)
        row["vs_scipy"] = row["run_s"] / row["scipy"]["run_s"]
        rows.append(row)
        print(f"defaults {name} {n}^2: solvax {row['status']} {row['steps']} steps, "
              f"{row['inner']} inner, {row['run_s']:.3f} s; SciPy {row['scipy']['steps']} "
              f"steps {row['scipy']['run_s']:.3f} s: {row['vs_scipy']:.2f}x", flush=True)
    return rows


def forcing(small):
    rows = []
    for name, n, precond in ([("bratu 6", 16, False), ("bratu 6", 16, True)] if small else
                             [("bratu 6", 128, False), ("convection", 128, False),
                              ("bratu 6", 256, True)]):
        F, _, builder = problem(name, n)
        options = dict(precond_builder=builder) if precond else {}
        row = dict(problem=name, n=n, multigrid=precond)
        for f in FORCINGS:
            row[str(f)] = solvax_run(F, n, 1, forcing=f, **options)
        best = min(row[str(f)]["inner"] for f in FORCINGS)
        row["default_vs_best"] = row["eisenstat_walker"]["inner"] / best
        rows.append(row)
        print(f"forcing {name} {n}^2{' multigrid' if precond else ''}: " + ", ".join(
            f"{f}: {row[str(f)]['inner']} inner / {row[str(f)]['steps']} steps"
            for f in FORCINGS) + f"; default / best {row['default_vs_best']:.2f}", flush=True)
    return rows


def derivative(small):
    n = 16 if small else 64

    def mean_root(lam):
        return jnp.mean(sx.newton_krylov(bratu(n, lam), jnp.zeros((n, n)), rtol=1e-13).u)

    lam, eps = 6.0, 1e-4
    grad = float(jax.jit(jax.grad(mean_root))(lam))
    central = float((mean_root(lam + eps) - mean_root(lam - eps)) / (2 * eps))
    out = dict(n=n, grad=grad, central=central, relative_error=abs(grad - central) / abs(central))
    print(f"d mean(u) / d lambda at {n}^2: grad {grad:.10f}, central difference "
          f"{central:.10f}: relative error {out['relative_error']:.1e}", flush=True)
    return out


def main():
    args = parse_args(__doc__)
    run_parts(args, (("multigrid", multigrid), ("defaults", defaults), ("forcing", forcing),
                     ("derivative", derivative)),
              {"jax": jax.__version__, "cpu_count": os.cpu_count(), "rtol": RTOL}, args.small)


if __name__ == "__main__":
    main()
