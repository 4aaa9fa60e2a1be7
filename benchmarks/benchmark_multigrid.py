"""Multigrid-preconditioned Krylov solves on structured grids, beside pyamg.

    python benchmarks/benchmark_multigrid.py [--json PATH] [--plot PATH] [--small] [--only TEXT]

One device, float64 (float32 where marked). Every solve runs to a true
relative residual of 1e-8 (checked on the returned x). Parts (`--only`):

- `sizes`: `pcg` preconditioned by `sx.multigrid` (V(2,2) cycle, Jacobi and
  Chebyshev smoothing) on the cell-centred Poisson problem
  (`sx.diffusion_operator(1.0)`, Dirichlet) at 64^2, 256^2, 1024^2 and 32^3,
  64^3, 128^3: iterations vs grid size, beside pyamg's Ruge-Stueben
  hierarchy as a CG preconditioner on the same matrix.
- `coefficients`: coefficients jumping by 1e4 on blocks, a smooth log-normal
  field (contrast ~1e3), anisotropic `k = (1e-3, 1)` (2-D) and
  `(1, 1, 1e-3)` (3-D), and float32.
- `nonsymmetric`: upwind convection-diffusion (the peers benchmark's
  operator, strength 10) with `gmres` and `bicgstab`.
- `blocks`: random blocks of contrast 1e4 (16^2, 8^2, 4^2 cells at 256^2
  and 512^2, 8^3 and 4^3 at 64^3) with the default (its configuration
  chosen from the coefficients, `rule.py`), the plain configuration (the
  default before) and issue 39's recipe (`"full"` interpolation,
  Gauss-Seidel, a coarsest level of spacing 4 cells solved by lines), the
  first two timed with the set-up, beside pyamg's Ruge-Stueben (timed:
  set-up + solve) and smoothed aggregation.
- `shifted`: 20 backward-Euler steps at 256^2 on random blocks (8^2 and
  4^2 cells, 1 and 1e3) for `dt` from 1e-3 to 1e-6, and 5 at 64^3 (4^3
  cells) for `dt` 1e-2 and 1e-4: the default configuration against the
  plain one (in 3-D also the lines the rule takes unshifted), iterations
  and warm time.
- `cycles`: V, W and F cycles on Poisson and a log-normal field at 256^2,
  preconditioning CG (GMRES for the F-cycle) and alone (`multigrid_solve`):
  iterations and warm time.
- `time`: Poisson 1024^2, compiled and warm, set-up included (the
  coefficient field is an argument of the jitted function, so the hierarchy
  is built in every call): solvax's multigrid-preconditioned CG against
  pyamg's Ruge-Stueben set-up + CG solve and against `pcg` without a
  preconditioner; solvax's compile time; the same with the coarsest level
  (at most 4096 points) solved by lines (`coarse="lines"`); the hierarchy
  built once and passed to the jitted solve or closed over by it (warm
  time, no set-up).

`--small` runs every part on grids of at most 32^2 / 8^3 (a smoke test).
"""

import math
import os
import statistics
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from problems import interleaved, median_time, parse_args, run_parts  # noqa: E402

import solvax as sx  # noqa: E402

RTOL = 1e-8


def to_csr(op):
    """The stencil operator as a scipy CSR matrix (rows in C order)."""
    import scipy.sparse as sp

    shape = op.shape
    size = math.prod(shape)
    index = np.arange(size).reshape(shape)
    rows, cols, vals = [], [], []
    for offset, coefficient in op.entries.items():
        c = np.broadcast_to(np.asarray(coefficient), shape)
        target = [np.arange(n)[tuple(slice(None) if b == a else None for b in range(len(shape)))]
                  + o for a, (n, o) in enumerate(zip(shape, offset))]
        target = np.broadcast_arrays(*target)
        inside = np.ones(shape, bool)
        for t, n in zip(target, shape):
            inside &= (t >= 0) & (t < n)
        rows.append(index[inside])
        cols.append(np.ravel_multi_index([t[inside] for t in target], shape))
        vals.append(c[inside])
    return sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                         shape=(size, size))


def relative_residual(op, x, b):
    return float(jnp.linalg.norm(b - op(x)) / jnp.linalg.norm(b))


def rhs(shape, dtype=jnp.float64, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def mg_solve(op, b, solver=sx.pcg, timed=False, **options):
    """Iterations and true residual of `solver(op, b, precond=multigrid(op))`;
    `timed`: also its warm time with the set-up (median of 3), the set-up
    from the concrete coefficients (as a user calls it: the default reads
    them, `rule.py`) and the solve jitted."""
    mg = sx.multigrid(op, **options)
    solve = jax.jit(lambda m, b: solver(op, b, precond=m, rtol=RTOL, atol=0.0))
    sol = solve(mg, b)
    out = dict(iterations=int(sol.iterations), status=sx.Status(int(sol.status)).name,
               residual=relative_residual(op, sol.x, b), levels=len(mg.shapes),
               coarsest=list(mg.shapes[-1]), coarse=mg.coarse)
    if timed:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(solve(sx.multigrid(op, **options), b).x)
            times.append(time.perf_counter() - start)
        out["seconds"] = statistics.median(times)
    return out


def pyamg_solve(op, b, method="ruge_stuben"):
    """pyamg's hierarchy as a CG preconditioner: set-up and solve times, iterations."""
    import pyamg

    A = to_csr(op)
    bn = np.asarray(b).ravel()
    start = time.perf_counter()
    ml = (pyamg.ruge_stuben_solver(A) if method == "ruge_stuben"
          else pyamg.smoothed_aggregation_solver(A))
    setup = time.perf_counter() - start
    residuals = []
    start = time.perf_counter()
    x = ml.solve(bn, tol=RTOL, accel="cg", residuals=residuals, maxiter=200)
    solve = time.perf_counter() - start
    true = float(np.linalg.norm(bn - A @ x) / np.linalg.norm(bn))
    return dict(iterations=len(residuals) - 1, setup_s=setup, solve_s=solve, residual=true)


def sizes(small):
    grids = [(16, 16), (32, 32), (8, 8, 8)] if small else [
        (64, 64), (256, 256), (1024, 1024), (32, 32, 32), (64, 64, 64), (128, 128, 128)]
    rows = []
    for shape in grids:
        op = sx.diffusion_operator(1.0, shape=shape)
        b = rhs(shape)
        row = dict(shape=list(shape))
        for smoother in ("jacobi", "chebyshev"):
            row[smoother] = mg_solve(op, b, smoother=smoother)
        row["pyamg_rs"] = pyamg_solve(op, b)
        rows.append(row)
        print(f"{str(shape):16s} jacobi {row['jacobi']['iterations']:3d}  chebyshev "
              f"{row['chebyshev']['iterations']:3d}  pyamg RS {row['pyamg_rs']['iterations']:3d}",
              flush=True)
    return rows


def coefficient_fields(shape, seed=0):
    """Blocks jumping by 1e4, and a smooth log-normal field (contrast ~1e3)."""
    rng = np.random.default_rng(seed)
    grids = np.meshgrid(*[np.arange(n) / n for n in shape], indexing="ij")
    checker = sum(np.floor(4 * g) for g in grids) % 2
    jumps = np.where(checker == 1, 1e4, 1.0)
    smooth = sum(np.cos(2 * np.pi * (f * g + rng.uniform()))
                 for f in (1, 2, 3) for g in grids)
    lognormal = np.exp(np.log(1e3) * (smooth - smooth.min()) / np.ptp(smooth) - np.log(1e3) / 2)
    return dict(jumps=jumps, lognormal=lognormal)


def coefficients(small):
    rows = []
    shapes2, shapes3 = ([(32, 32)], [(8, 8, 8)]) if small else ([(256, 256)], [(64, 64, 64)])
    for shape in shapes2 + shapes3:
        for name, k in coefficient_fields(shape).items():
            op = sx.diffusion_operator(jnp.asarray(k))
            rows.append(dict(case=name, shape=list(shape), contrast=float(k.max() / k.min()),
                             **mg_solve(op, rhs(shape))))
    for shape, k in [(shapes2[0], (1e-3, 1.0)), (shapes3[0], (1.0, 1.0, 1e-3))]:
        op = sx.diffusion_operator(k, shape=shape)
        rows.append(dict(case=f"anisotropic {k}", shape=list(shape), **mg_solve(op, rhs(shape))))
    shape = shapes2[0]
    op = sx.diffusion_operator(jnp.float32(1.0), shape=shape)
    b = rhs(shape, jnp.float32)
    mg = sx.multigrid(op)
    sol = jax.jit(lambda m, b: sx.pcg(op, b, precond=m))(mg, b)
    rows.append(dict(case="float32 (default tolerance)", shape=list(shape),
                     iterations=int(sol.iterations), status=sx.Status(int(sol.status)).name,
                     residual=relative_residual(op, sol.x, b)))
    for r in rows:
        print(f"{r['case']:28s} {str(tuple(r['shape'])):14s} {r['iterations']:3d} iterations "
              f"({r['status']}, residual {r['residual']:.1e})", flush=True)
    return rows


def convection(n, strength):
    """The peers benchmark's upwind convection-diffusion as a stencil:
    `-Laplace u + strength * h * (u_i - u_{i-1})` along axis 0, h = 1 / (n + 1)."""
    ch = strength / (n + 1)
    return sx.stencil_operator({(0, 0): 4.0 + ch, (-1, 0): -1.0 - ch, (1, 0): -1.0,
                                (0, 1): -1.0, (0, -1): -1.0}, shape=(n, n))


def nonsymmetric(small):
    n = 32 if small else 256
    op = convection(n, 10.0)
    b = rhs((n, n))
    rows = []
    for name, solver in (("gmres", sx.gmres), ("bicgstab", sx.bicgstab)):
        rows.append(dict(solver=name, n=n, strength=10.0, **mg_solve(op, b, solver=solver)))
        print(f"convection-diffusion {n}^2 {name:9s} {rows[-1]['iterations']:3d} iterations "
              f"({rows[-1]['status']})", flush=True)
    return rows


# the random-block family (issues 39, 51): the default (its configuration
# chosen from the coefficients, `rule.py`), the plain configuration (the
# default before: collapsed interpolation, a dense coarsest level of 64
# points), and the hand-made recipe of issue 39: full interpolation,
# Gauss-Seidel, lines at the smallest blocks' scale (`coarse_size` filled in
# per grid in `blocks`)
PLAIN = dict(interpolation="collapsed", coarse="direct")
BLOCK_CONFIGS = {"default": {}, "plain": PLAIN,
                 "full, Gauss-Seidel, lines": dict(interpolation="full",
                                                   smoother="gauss_seidel", coarse="lines")}
# configurations timed (warm, set-up included) beside pyamg's set-up + solve
TIMED_BLOCK_CONFIGS = ("default", "plain")


def random_blocks(shape, size, seed=0, contrast=1e4):
    """Cell-centred coefficients, each block of `size` cells per axis 1 or
    `contrast` at random (50/50)."""
    rng = np.random.default_rng(seed)
    k = np.where(rng.random(tuple(n // size for n in shape)) < 0.5, contrast, 1.0)
    for axis in range(len(shape)):
        k = np.repeat(k, size, axis=axis)
    return k


def blocks(small):
    """MG-CG on random blocks of contrast 1e4 (harmonic face means, written
    as a general 5- or 7-point `stencil_operator`), beside pyamg's Ruge-Stueben
    and smoothed aggregation on the same matrices."""
    cases = ([((32, 32), 8), ((32, 32), 4), ((8, 8, 8), 4)] if small else
             [((256, 256), 16), ((256, 256), 8), ((256, 256), 4), ((512, 512), 16),
              ((512, 512), 8), ((512, 512), 4), ((64, 64, 64), 8), ((64, 64, 64), 4)])
    rows = []
    for shape, size in cases:
        k = jnp.asarray(random_blocks(shape, size))
        op = sx.stencil_operator(sx.diffusion_operator(k).entries)  # stored whole
        b = rhs(shape)
        row = dict(shape=list(shape), block=size)
        for name, options in BLOCK_CONFIGS.items():
            if options.get("coarse") == "lines":
                options = dict(options, coarse_size=max(1, math.prod(shape) // 4 ** len(shape)))
            row[name] = mg_solve(op, b, timed=name in TIMED_BLOCK_CONFIGS, **options)
        row["pyamg_rs"] = pyamg_solve(op, b)
        row["pyamg_sa"] = pyamg_solve(op, b, method="smoothed_aggregation")
        rows.append(row)
        print(f"{str(shape):14s} blocks of {size:2d}: " + ", ".join(
            f"{name} {row[name]['iterations']}" for name in BLOCK_CONFIGS)
            + f"; pyamg RS {row['pyamg_rs']['iterations']}, SA {row['pyamg_sa']['iterations']}"
            + "; time (s, set-up included) " + ", ".join(
                f"{name} {row[name]['seconds']:.3f}" for name in TIMED_BLOCK_CONFIGS)
            + f", pyamg RS {row['pyamg_rs']['setup_s'] + row['pyamg_rs']['solve_s']:.3f}",
            flush=True)
    return rows


def backward_euler(op, u, steps, dt, mg):
    """`steps` backward-Euler steps of `u' = -A u + 1` with the operator
    `I / dt + A` (`op`) preconditioned by `mg`: the final `u` and the total
    CG iterations."""
    def step(carry, _):
        u, total = carry
        sol = sx.pcg(op, u / dt + 1.0, x0=u, precond=mg, rtol=RTOL, atol=0.0)
        return (sol.x, total + sol.iterations), None

    (u, total), _ = jax.lax.scan(step, (u, jnp.zeros((), jnp.int32)), None, length=steps)
    return u, total


def _same_hierarchy(a, b) -> bool:
    """Whether two hierarchies hold the same arrays in the same structure."""
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    return tree_a == tree_b and all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))


def shifted(small):
    """A backward-Euler loop on rough coefficients (issue 51): 20 steps at
    256^2 of `u/dt - div(k grad u) = u_prev/dt + 1` (h = 1/256), `k` random
    50/50 blocks of 8^2 or 4^2 cells valued 1 and 1e3, for several `dt`: the
    default configuration (chosen from the coefficients) against the plain
    one, each hierarchy built once from the concrete operator (the operator
    does not change between steps), its warm time for the 20 steps
    (interleaved rounds) and with the set-up. Total CG iterations. In 3-D
    (5 steps at 64^3 on blocks of 4^3 cells) also the configuration the rule
    takes there unshifted (`lines`: full interpolation, a 16^3 level solved
    by lines), which a time-stepping shift makes it leave."""
    cases = ([((32, 32), 8, (1e-4,), 4), ((16, 16, 16), 4, (1e-2,), 2)] if small else
             [((256, 256), size, (1e-3, 1e-4, 1e-5, 1e-6), 20) for size in (8, 4)]
             + [((64, 64, 64), 4, (1e-2, 1e-4), 5)])
    rows = []
    for shape, size, dts, steps in cases:
        n = shape[0]
        k = jnp.asarray(random_blocks(shape, size, contrast=1e3))
        for dt in dts:
            op = sx.diffusion_operator(k, spacing=1 / n, shift=1 / dt)
            u0 = jnp.zeros(shape)
            configs = {"default": {}, "plain": PLAIN}
            if len(shape) == 3:
                configs["lines"] = dict(interpolation="full", coarse="lines",
                                        coarse_size=math.prod(shape) // 64)
            hierarchies = {name: sx.multigrid(op, **c) for name, c in configs.items()}
            # the rule chose the plain configuration: one hierarchy, timed once (two
            # timings of one program measure only this machine's drift: 1.03-1.38x)
            same = _same_hierarchy(hierarchies["default"], hierarchies["plain"])
            if same:
                del configs["default"], hierarchies["default"]
            # each run reads its own hierarchy of those passed in
            runs = {name: (lambda hs, u, name=name, op=op, dt=dt, steps=steps:
                           backward_euler(op, u, steps, dt, hs[name])) for name in hierarchies}
            row = dict(n=n, dims=len(shape), block=size, dt=dt, steps=steps,
                       default_coarse=hierarchies["plain" if same else "default"].coarse,
                       same_hierarchy=same)
            for name, run in runs.items():
                row[f"{name}_iterations"] = int(jax.jit(run)(hierarchies, u0)[1])
            times = interleaved(runs, hierarchies, u0, rounds=5)
            for name, options in configs.items():
                start = time.perf_counter()
                jax.block_until_ready(sx.multigrid(op, **options))
                row[f"{name}_s"] = times[name]
                row[f"{name}_with_setup_s"] = times[name] + time.perf_counter() - start
            if same:
                for key in ("iterations", "s", "with_setup_s"):
                    row[f"default_{key}"] = row[f"plain_{key}"]
            row["default_vs_plain"] = row["default_s"] / row["plain_s"]
            rows.append(row)
            ratio = "the same hierarchy" if same else f"{row['default_vs_plain']:.2f}x"
            lines = (f"; lines {row['lines_iterations']} iterations {row['lines_s']:.3f} s "
                     f"({row['lines_s'] / row['plain_s']:.2f}x)" if "lines" in configs else "")
            print(f"backward Euler {n}^{len(shape)}, blocks of {size}, dt {dt:g} (shift "
                  f"{1 / dt:g}): default ({row['default_coarse']}) {row['default_iterations']} "
                  f"iterations {row['default_s']:.3f} s, plain {row['plain_iterations']} "
                  f"iterations {row['plain_s']:.3f} s: {ratio}{lines}",
                  flush=True)
    return rows


def cycles(small):
    """V, W and F cycles on Poisson and a log-normal field (256^2): as CG's
    preconditioner (V, W; F is not symmetric: GMRES) and alone
    (`multigrid_solve`), iterations and warm time to 1e-8, set-up excluded."""
    n = 32 if small else 256
    rng = np.random.default_rng(0)
    fields = {"poisson": jnp.ones((n, n)),
              "lognormal": jnp.asarray(np.exp(rng.standard_normal((n, n))))}
    b = rhs((n, n))
    rows = []
    for name, k in fields.items():
        op = sx.diffusion_operator(k)
        for cycle in sx._grid.multigrid.CYCLES:
            mg = sx.multigrid(op, cycle=cycle)
            krylov = sx.pcg if cycle != "F" else sx.gmres
            fns = {"krylov": lambda m, b, op=op, krylov=krylov: krylov(op, b, precond=m,
                                                                      rtol=RTOL),
                   "alone": lambda m, b, op=op: sx.multigrid_solve(op, b, precond=m, rtol=RTOL,
                                                                   max_cycles=200)}
            row = dict(field=name, n=n, cycle=cycle, krylov=krylov.__name__)
            for key, fn in fns.items():
                sol = jax.jit(fn)(mg, b)
                row[f"{key}_iterations"] = int(sol.iterations)
                row[f"{key}_converged"] = bool(sol.converged)
                row[f"{key}_s"] = median_time(lambda b, fn=fn, mg=mg: fn(mg, b).x, b)
            rows.append(row)
            print(f"{name:9s} {n}^2 {cycle}-cycle: {row['krylov']} {row['krylov_iterations']} "
                  f"iterations {row['krylov_s']:.3f} s; cycles alone {row['alone_iterations']}"
                  f"{'' if row['alone_converged'] else ' (not converged)'} "
                  f"{row['alone_s']:.3f} s", flush=True)
    return rows


def timing(small):
    n = 64 if small else 1024
    repeats = 7   # this machine drifts by 10-15 % between runs
    k = jnp.ones((n, n))
    b = rhs((n, n))

    def mg(k, b):
        op = sx.diffusion_operator(k)
        return sx.pcg(op, b, precond=sx.multigrid(op), rtol=RTOL, atol=0.0)

    def mg_single(k, b):
        # the hierarchy and its cycle in float32 preconditioning a float64 CG
        # (docs/multigrid.md): half the memory traffic of every cycle
        op = sx.diffusion_operator(k)
        return sx.pcg(op, b, precond=sx.multigrid(op, dtype=jnp.float32), rtol=RTOL, atol=0.0)

    def plain(k, b):
        return sx.pcg(sx.diffusion_operator(k), b, rtol=RTOL, atol=0.0, max_steps=100000)

    out = dict(n=n)
    start = time.perf_counter()
    compiled = jax.jit(mg).lower(k, b).compile()
    out["mg_compile_s"] = time.perf_counter() - start
    sol = compiled(k, b)
    op = sx.diffusion_operator(k)
    out["mg_iterations"] = int(sol.iterations)
    out["mg_residual"] = relative_residual(op, sol.x, b)
    out["mg_s"] = median_time(mg, k, b, repeats=repeats)
    single = jax.jit(mg_single)(k, b)
    out["mg_f32_cycle_iterations"] = int(single.iterations)
    out["mg_f32_cycle_residual"] = relative_residual(op, single.x, b)
    out["mg_f32_cycle_s"] = median_time(mg_single, k, b, repeats=repeats)
    out["cg_iterations"] = int(jax.jit(plain)(k, b).iterations)
    out["cg_s"] = median_time(plain, k, b, repeats=1 if not small else repeats)
    amg = [pyamg_solve(op, b) for _ in range(repeats)]
    out["pyamg_rs_s"] = statistics.median(a["setup_s"] + a["solve_s"] for a in amg)
    out["pyamg_rs_iterations"] = amg[0]["iterations"]
    out["mg_vs_pyamg"] = out["mg_s"] / out["pyamg_rs_s"]
    out["cg_vs_mg"] = out["cg_s"] / out["mg_s"]
    out["mg_f32_cycle_vs_pyamg"] = out["mg_f32_cycle_s"] / out["pyamg_rs_s"]
    out["cg_vs_mg_f32_cycle"] = out["cg_s"] / out["mg_f32_cycle_s"]
    print(f"Poisson {n}^2, set-up included: multigrid-CG {out['mg_s']:.3f} s "
          f"({out['mg_iterations']} iterations; compile {out['mg_compile_s']:.1f} s), "
          f"pyamg RS {out['pyamg_rs_s']:.3f} s ({out['pyamg_rs_iterations']}), "
          f"CG {out['cg_s']:.2f} s ({out['cg_iterations']}): "
          f"{out['mg_vs_pyamg']:.2f}x pyamg, {out['cg_vs_mg']:.0f}x faster than CG; with a "
          f"float32 cycle {out['mg_f32_cycle_s']:.3f} s ({out['mg_f32_cycle_iterations']} "
          f"iterations, residual {out['mg_f32_cycle_residual']:.1e}): "
          f"{out['mg_f32_cycle_vs_pyamg']:.2f}x pyamg, {out['cg_vs_mg_f32_cycle']:.0f}x faster "
          "than CG", flush=True)
    out.update(_lines_timing(k, b, repeats))
    out.update(_built_once_timing(k, b, repeats))
    return out


def _built_once_timing(k, b, repeats):
    """The hierarchy built once, outside the timed solve: passed to the jitted
    MG-CG as an argument, and closed over by it (a constant in its program;
    its cycle must keep its fusion barriers, docs/multigrid.md). Warm time
    without set-up, interleaved rounds."""
    op = sx.diffusion_operator(k)
    mg = jax.jit(sx.multigrid)(op)
    runs = {"given": lambda mg, b: sx.pcg(op, b, precond=mg, rtol=RTOL, atol=0.0),
            # its own `mg` argument unused: the closed-over hierarchy runs
            "closed": lambda _, b: sx.pcg(op, b, precond=mg, rtol=RTOL, atol=0.0)}
    out = {f"mg_{name}_iterations": int(jax.jit(fn)(mg, b).iterations)
           for name, fn in runs.items()}
    times = interleaved(runs, mg, b, rounds=repeats)
    out.update({f"mg_{name}_s": t for name, t in times.items()})
    print(f"  the hierarchy built once: passed in {out['mg_given_s']:.3f} s, closed over "
          f"{out['mg_closed_s']:.3f} s ({out['mg_closed_iterations']} iterations)", flush=True)
    return out


def _lines_timing(k, b, repeats):
    """Compile, warm time and iterations of MG-CG with a coarsest level of at
    most 4096 points solved by lines (fewer levels: a shorter program)."""
    coarse_size = min(4096, k.size // 16)

    def mg_lines(k, b):
        op = sx.diffusion_operator(k)
        return sx.pcg(op, b, precond=sx.multigrid(op, coarse="lines", coarse_size=coarse_size),
                      rtol=RTOL, atol=0.0)

    start = time.perf_counter()
    compiled = jax.jit(mg_lines).lower(k, b).compile()
    out = dict(mg_lines_compile_s=time.perf_counter() - start,
               mg_lines_iterations=int(compiled(k, b).iterations),
               mg_lines_s=median_time(mg_lines, k, b, repeats=repeats))
    print(f"  with the coarsest level ({coarse_size} points at most) solved by lines: "
          f"{out['mg_lines_s']:.3f} s ({out['mg_lines_iterations']} iterations; compile "
          f"{out['mg_lines_compile_s']:.1f} s)", flush=True)
    return out


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for dim, marker in ((2, "o"), (3, "s")):
        rows = [r for r in out["sizes"] if len(r["shape"]) == dim]
        unknowns = [math.prod(r["shape"]) for r in rows]
        for key, label in (("jacobi", "solvax MG-CG, Jacobi"),
                           ("chebyshev", "solvax MG-CG, Chebyshev"),
                           ("pyamg_rs", "pyamg Ruge-Stueben CG")):
            ax.plot(unknowns, [r[key]["iterations"] for r in rows], marker=marker,
                    label=f"{label} ({dim}-D)")
    ax.set_xscale("log")
    ax.set_xlabel("unknowns")
    ax.set_ylabel("iterations to 1e-8")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    args = parse_args(__doc__)
    out = run_parts(args, (("sizes", sizes), ("coefficients", coefficients),
                           ("nonsymmetric", nonsymmetric), ("blocks", blocks),
                           ("shifted", shifted),
                           ("cycles", cycles), ("time", timing)),
                    {"jax": jax.__version__, "cpu_count": os.cpu_count(), "rtol": RTOL},
                    args.small)
    if args.plot and "sizes" in out:
        plot(out, args.plot)


if __name__ == "__main__":
    main()
