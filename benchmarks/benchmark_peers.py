"""solvax against jax.scipy.sparse.linalg and lineax, same problems, same stopping rule.

    python benchmarks/benchmark_peers.py [--json PATH] [--plot PATH] [--small] [--only PART]
                                         [--one-device]

`--one-device` runs the process on one CPU device (no emulated mesh): the
target the reduction layer's `stacks_products` rule gives separate sums
(the mesh parts then have nothing to run on and are skipped).

Stopping rule for everyone: 2-norm residual <= 1e-8 ||b|| (lineax: two_norm,
rtol=0, atol=1e-8 ||b||); GMRES restart 30. Problems: 5-point Poisson 512 x 512
(CG family), upwind convection-diffusion 256 x 256 with strength 10 (GMRES,
BiCGStab and IDR(s)), a saddle-point system on two 128 x 128 grids (MINRES
against GMRES), a 16-leaf pytree right-hand side (compile time), and a
BiCGStab sweep on one device: upwind convection-diffusion at
strengths 10, 100 and 1000 on 128 x 128 and 512 x 512 grids, solvax's
default `bicgstab` against `jax.scipy.sparse.linalg.bicgstab` (interleaved
medians, matvecs, true residual); a latency-bound mesh: 8 emulated
devices, a diagonal operator on 4096 (and 65536) entries sharded P('i'),
200 fixed iterations (CG and BiCGStab variants, beside the floor: a loop of
one or two scalar all-reduces and nothing else); multigrid-preconditioned CG
on 8 devices with the coarsest grid gathered or smoothed (`multigrid_mesh`);
and the nonlinear row:
`newton_krylov` with its defaults against SciPy's `newton_krylov` on Bratu
(λ = 6, 128 x 128; `benchmark_newton.py` has the rest). Reported: compile time
(lower + compile, caches cleared; median of 5 with the solvers interleaved
round-robin, and its ratio to jax.scipy's solver of the same method), median
run time over 5 warm runs with the solvers interleaved round-robin, matvecs,
true final relative residual, time per matvec and the ratio to the fastest
peer of the same method family (`FAMILY`: IDR(s) is measured against the
BiCGStab peers, the short-recurrence methods it competes with; MINRES
against solvax's GMRES, no peer has MINRES).
`--small` shrinks every problem and measures each time once (a smoke test).
"""

import functools
import json
import os
import statistics
import sys
import time

ONE_DEVICE = "--one-device" in sys.argv
if ONE_DEVICE:
    sys.argv.remove("--one-device")
elif "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import benchmark_newton  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.scipy.sparse.linalg as jsp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from problems import (  # noqa: E402
    convection_diffusion,
    interleaved,
    latency_problem,
    parse_args,
    poisson,
    saddle_point,
)

import solvax as sx  # noqa: E402

try:
    import lineax as lx
    import lineax.internal  # noqa: F401  (two_norm)
except ImportError:  # the `bench` extra is optional
    lx = None

RTOL = 1e-8
REPEATS = 5
COMPILE_REPEATS = 5
WARMUP_ROUNDS = 1  # unmeasured compile rounds first (none in a --small smoke run)
LATENCY_REPEATS = 21  # the latency part's rounds (a --small run: 1)
S_VALUES = (2, 4, 8)  # s-step CG's s (a --small smoke run: s = 4 alone)
IDR_S_VALUES = (1, 2, 4, 8)  # IDR(s)'s s (likewise)


def family(solver):
    """The method family a solver's run time is compared within."""
    for name in ("bicgstab", "idrs", "gmres", "minres"):
        if name in solver.lower():
            return "bicgstab" if name == "idrs" else "gmres" if name == "minres" else name
    return "cg"


def lineax_solve(matvec, b, solver_cls, tags=(), **kw):
    operator = lx.FunctionLinearOperator(matvec, jax.eval_shape(lambda: b), tags=tags)
    bnorm = jnp.linalg.norm(b)
    solver = solver_cls(rtol=0.0, atol=RTOL * bnorm, norm=lx.internal.two_norm, **kw)
    return lx.linear_solve(operator, b, solver, throw=False).value


def cg_solvers(matvec):
    out = {
        "solvax pcg": lambda b: sx.pcg(matvec, b, rtol=RTOL).x,
        "solvax pcg single_reduction": lambda b: sx.pcg(matvec, b, rtol=RTOL,
                                                         single_reduction=True).x,
        "solvax pcg pipelined": lambda b: sx.pcg(matvec, b, rtol=RTOL, method="pipelined").x,
        **{f"solvax pcg s_step s={s}": (lambda b, s=s: sx.pcg(matvec, b, rtol=RTOL,
                                                              method="s_step", s=s).x)
           for s in S_VALUES},
        "jax.scipy cg": lambda b: jsp.cg(matvec, b, tol=RTOL, atol=0.0)[0],
    }
    if lx is not None:
        out["lineax CG"] = lambda b: lineax_solve(
            matvec, b, lx.CG, tags=(lx.symmetric_tag, lx.positive_semidefinite_tag),
            max_steps=100000)
    return out


def gmres_solvers(matvec):
    out = {
        "solvax gmres one_sync": lambda b: sx.gmres(matvec, b, restart=30, rtol=RTOL).x,
        "solvax gmres cgs2": lambda b: sx.gmres(matvec, b, restart=30, rtol=RTOL,
                                                orthogonalization="cgs2").x,
        "jax.scipy gmres batched": lambda b: jsp.gmres(matvec, b, tol=RTOL, atol=0.0,
                                                       restart=30, maxiter=400,
                                                       solve_method="batched")[0],
        "jax.scipy gmres incremental": lambda b: jsp.gmres(matvec, b, tol=RTOL, atol=0.0,
                                                           restart=30, maxiter=400,
                                                           solve_method="incremental")[0],
    }
    if lx is not None:
        out["lineax GMRES"] = lambda b: lineax_solve(matvec, b, lx.GMRES, restart=30,
                                                     max_steps=100000)
    return out


def nonsymmetric_solvers(matvec):
    out = {
        **gmres_solvers(matvec),
        "solvax bicgstab": lambda b: sx.bicgstab(matvec, b, rtol=RTOL).x,
        "solvax bicgstab one_sync": lambda b: sx.bicgstab(matvec, b, rtol=RTOL,
                                                          method="one_sync").x,
        **{f"solvax idrs s={s}": (lambda b, s=s: sx.idrs(matvec, b, s=s, rtol=RTOL).x)
           for s in IDR_S_VALUES},
        "jax.scipy bicgstab": lambda b: jsp.bicgstab(matvec, b, tol=RTOL, atol=0.0,
                                                     maxiter=100000)[0],
    }
    if lx is not None:
        out["lineax BiCGStab"] = lambda b: lineax_solve(matvec, b, lx.BiCGStab,
                                                        max_steps=100000)
    return out


def indefinite_solvers(matvec):
    return {
        "solvax minres": lambda b: sx.minres(matvec, b, rtol=RTOL).x,
        "solvax gmres one_sync": lambda b: sx.gmres(matvec, b, restart=30, rtol=RTOL).x,
        "jax.scipy gmres batched": lambda b: jsp.gmres(matvec, b, tol=RTOL, atol=0.0,
                                                       restart=30, maxiter=400,
                                                       solve_method="batched")[0],
    }


def count_matvecs(solve, matvec, b):
    """Matvecs a solve performs, counted by a host callback (not in the timed runs)."""
    count = [0]

    def bump():
        count[0] += 1

    def counted(x):
        jax.debug.callback(bump)
        return matvec(x)

    jax.block_until_ready(jax.jit(solve(counted))(b))
    return count[0]


def compile_times(fns, *args):
    """Median cold lower + compile time of each function (caches cleared, so no
    run is a cache hit), COMPILE_REPEATS rounds with the functions interleaved
    round-robin (machine drift then hits all alike), after one unmeasured round."""
    times = {name: [] for name in fns}
    for round_ in range(COMPILE_REPEATS + WARMUP_ROUNDS):
        for name, fn in fns.items():
            jax.clear_caches()
            start = time.perf_counter()
            jax.jit(fn).lower(*args).compile()
            if round_ >= WARMUP_ROUNDS:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def problem(name, matvec, make_solvers, b, reference):
    """Every solver of `make_solvers(matvec)` on `b`; compile times are also
    given relative to `reference` (jax.scipy's solver of the same method)."""
    bnorm = norm(b)
    by_matvec = make_solvers  # solver factory taking the matvec
    solvers = by_matvec(matvec)
    compiles = compile_times(solvers, b)
    runs = interleaved(solvers, b, rounds=REPEATS)
    rows = []
    for solver, fn in solvers.items():
        x = jax.jit(fn)(b)
        matvecs = count_matvecs(lambda mv, solver=solver: by_matvec(mv)[solver], matvec, b)
        residual = jax.tree_util.tree_map(jnp.subtract, b, matvec(x))
        rows.append(dict(problem=name, solver=solver, family=family(solver),
                         compile_s=compiles[solver],
                         compile_vs_jax_scipy=compiles[solver] / compiles[reference],
                         run_s=runs[solver], matvecs=matvecs,
                         true_relative_residual=norm(residual) / bnorm,
                         ms_per_matvec=1e3 * runs[solver] / max(matvecs, 1)))
    for r in rows:
        peers = [p["run_s"] for p in rows if p["family"] == r["family"]
                 and not p["solver"].startswith("solvax")]
        # MINRES: no peer has it; measured against solvax's GMRES
        peers = peers or [p["run_s"] for p in rows if p["family"] == r["family"]
                          and p["solver"] != r["solver"]]
        r["ratio_to_fastest_peer"] = r["run_s"] / min(peers)
    return rows


BICGSTAB_STRENGTHS = (10.0, 100.0, 1000.0)


def bicgstab_pair(matvec):
    """The default BiCGStab of solvax and of jax.scipy on `matvec`."""
    return {"solvax bicgstab": lambda b: sx.bicgstab(matvec, b, rtol=RTOL).x,
            "jax.scipy bicgstab": lambda b: jsp.bicgstab(matvec, b, tol=RTOL, atol=0.0,
                                                         maxiter=100000)[0]}


def bicgstab_sweep(sizes):
    """solvax's default `bicgstab` against jax.scipy's on one device:
    convection-diffusion at each strength and size (mesh Peclet number
    `strength * h / 2`), time to a true relative residual of 1e-8."""
    rows = []
    rng = np.random.default_rng(1)
    for n in sizes:
        b = jnp.asarray(1.0 + 0.1 * rng.standard_normal((n, n)))
        for strength in BICGSTAB_STRENGTHS:
            matvec = convection_diffusion(strength)
            runs = interleaved(bicgstab_pair(matvec), b, rounds=REPEATS)
            row = dict(n=n, strength=strength, peclet=strength / (n + 1) / 2)
            for name in runs:
                x = jax.jit(bicgstab_pair(matvec)[name])(b)
                key = "solvax" if name.startswith("solvax") else "jax_scipy"
                row[f"{key}_s"] = runs[name]
                row[f"{key}_matvecs"] = count_matvecs(
                    lambda mv, name=name: bicgstab_pair(mv)[name], matvec, b)
                row[f"{key}_true_relative_residual"] = norm(b - matvec(x)) / norm(b)
            row["ratio"] = row["solvax_s"] / row["jax_scipy_s"]
            rows.append(row)
    return rows


def norm(tree):
    return float(jnp.sqrt(sum(jnp.sum(jnp.abs(leaf) ** 2)
                              for leaf in jax.tree_util.tree_leaves(tree))))


def pytree_compile(n_leaves, size):
    b = {f"leaf{k}": jnp.ones(size) for k in range(n_leaves)}

    def mv(x):
        return jax.tree_util.tree_map(lambda v: 3.0 * v - jnp.roll(v, 1) - jnp.roll(v, -1), x)

    fns = {"solvax pcg": lambda b: sx.pcg(mv, b).x,
           "jax.scipy cg": lambda b: jsp.cg(mv, b)[0]}
    if lx is not None:
        def lineax_cg(b):
            operator = lx.FunctionLinearOperator(
                mv, jax.eval_shape(lambda: b),
                tags=(lx.symmetric_tag, lx.positive_semidefinite_tag))
            return lx.linear_solve(operator, b, lx.CG(rtol=1e-8, atol=0.0), throw=False).value
        fns["lineax CG"] = lineax_cg
    return compile_times(fns, b)


def latency(n, iterations=200):
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    sharding = NamedSharding(mesh, P("i"))
    # every run really takes the 200 steps (checked below)
    d, b = latency_problem(n, sharding)
    cg = {
        "solvax pcg": lambda d, b: sx.pcg(lambda x: d * x, b, rtol=0.0, max_steps=iterations).x,
        "solvax pcg single_reduction": lambda d, b: sx.pcg(
            lambda x: d * x, b, rtol=0.0, max_steps=iterations, single_reduction=True).x,
        "solvax pcg pipelined": lambda d, b: sx.pcg(
            lambda x: d * x, b, rtol=0.0, max_steps=iterations, method="pipelined").x,
        **{f"solvax pcg s_step s={s}": (lambda d, b, s=s: sx.pcg(
            lambda x: d * x, b, rtol=0.0, max_steps=iterations, method="s_step", s=s).x)
           for s in S_VALUES},
        "jax.scipy cg": lambda d, b: jsp.cg(lambda x: d * x, b, tol=0.0, atol=0.0,
                                            maxiter=iterations)[0],
    }
    bicgstab = {
        "solvax bicgstab": lambda d, b: sx.bicgstab(lambda x: d * x, b, rtol=0.0,
                                                    max_steps=iterations).x,
        "solvax bicgstab one_sync": lambda d, b: sx.bicgstab(
            lambda x: d * x, b, rtol=0.0, max_steps=iterations, method="one_sync").x,
        "jax.scipy bicgstab": lambda d, b: jsp.bicgstab(lambda x: d * x, b, tol=0.0, atol=0.0,
                                                        maxiter=iterations)[0],
    }
    # the step counts checked under `jit` (one program per solve): called
    # eagerly on the 8 emulated devices, a solve's small collective programs
    # queue up, and XLA's CPU runtime deadlocks on a queue of independent
    # 8-device collective programs (an abort after its 40 s rendezvous timeout)
    for method, s in (("standard", 4), ("single_reduction", 4), ("pipelined", 4),
                      *(("s_step", s) for s in S_VALUES)):
        options = dict(s=s) if method == "s_step" else {}
        steps = int(jax.jit(lambda d, b, method=method, options=options: sx.pcg(
            lambda x: d * x, b, rtol=0.0, max_steps=iterations, method=method,
            **options).iterations)(d, b))
        assert steps == iterations, (method, steps)
    for method in ("standard", "one_sync"):
        steps = int(jax.jit(lambda d, b, method=method: sx.bicgstab(
            lambda x: d * x, b, rtol=0.0, max_steps=iterations,
            method=method).iterations)(d, b))
        assert steps == iterations, (method, steps)
    # the floor: a loop of `iterations` steps doing one (two) all-reduces of
    # one scalar and nothing else (what one synchronization costs on this mesh)
    cg.update({f"floor: {k} all-reduce{'s' * (k > 1)}, nothing else":
               functools.partial(_floor, k=k, iterations=iterations) for k in (1, 2)})
    rows = []
    for fns, base in ((cg, "jax.scipy cg"), (bicgstab, "jax.scipy bicgstab")):
        # 21 rounds: a run is ~0.1 s, and this mesh's scheduling noise is large
        runs = interleaved(fns, d, b, rounds=max(REPEATS, LATENCY_REPEATS))
        # all-reduces executed per CG/BiCGStab iteration (each array of a
        # variadic one): an s-step loop pass is s iterations
        rows += [dict(problem=f"latency-bound mesh, n={n}, 8 devices", solver=k,
                      ms_per_iteration=1e3 * t / iterations, ratio_to_jax_scipy=t / runs[base],
                      all_reduces_per_iteration=sx.count_collectives(fns[k], d, b).step_count(
                          "all-reduce") / (int(k.split("s=")[1]) if "s_step" in k else 1))
                 for k, t in runs.items()]
    return rows


def _floor(d, b, k, iterations):
    def body(_, carry):
        x, total = carry
        for _ in range(k):
            total = total + 1e-9 * jnp.sum(x * x)
            x = 0.999 * x + 1e-12 * total
        return x, total

    return jax.lax.fori_loop(0, iterations, body, (b, jnp.zeros((), b.dtype)))[0]


def multigrid_mesh(sizes=(64, 256)):
    """Multigrid-preconditioned CG on 8 devices (rows split, `P('i', None)`),
    log-normal diffusion to 1e-8: the coarsest grid gathered and solved
    (`coarse="direct"`, one all-gather per iteration) against smoothed where
    it is split (`coarse="chebyshev"`, degree 8: halos only), the hierarchy
    built once outside the timed solve."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    sharding = NamedSharding(mesh, P("i", None))
    rng = np.random.default_rng(0)
    rows = []
    solve = jax.jit(lambda A, M, b: sx.pcg(A, b, precond=M, rtol=RTOL))

    def solve_x(A, M, b):
        return solve(A, M, b).x

    for n in sizes:
        k, b = (jax.device_put(jnp.asarray(v), sharding)
                for v in (np.exp(rng.standard_normal((n, n))), rng.standard_normal((n, n))))
        A = sx.diffusion_operator(k)
        fns, info = {}, {}
        for coarse in ("direct", "chebyshev"):
            M = sx.multigrid(A, coarse=coarse)
            sol = solve(A, M, b)
            report = sx.count_collectives(solve_x, A, M, b)
            fns[coarse] = functools.partial(solve_x, A, M)
            info[coarse] = dict(iterations=int(sol.iterations), per_step=report.per_step)
        runs = interleaved(fns, b, rounds=REPEATS)
        for coarse, t in runs.items():
            its = info[coarse]["iterations"]
            rows.append(dict(problem=f"MG-CG {n}x{n} P('i', None), 8 devices", coarse=coarse,
                             iterations=its, solve_s=t, ms_per_iteration=1e3 * t / its,
                             per_step=info[coarse]["per_step"]))
    return rows


def main():
    args = parse_args(__doc__)
    n_poisson, n_cd = (32, 16) if args.small else (512, 256)
    if args.small:  # a smoke test: one measurement each
        global REPEATS, COMPILE_REPEATS, WARMUP_ROUNDS, S_VALUES, IDR_S_VALUES, LATENCY_REPEATS
        REPEATS = COMPILE_REPEATS = LATENCY_REPEATS = 1
        WARMUP_ROUNDS = 0
        S_VALUES = IDR_S_VALUES = (4,)
    rng = np.random.default_rng(0)
    meta = {"jax": jax.__version__, "lineax": getattr(lx, "__version__", None),
            "devices": jax.device_count(),
            "stacks_products": sx._core.reduce.stacks_products(),
            "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
            "repeats": REPEATS, "compile_repeats": COMPILE_REPEATS, "rtol": RTOL}
    print(meta)
    rows = []
    # --only: the parts whose name contains it (poisson, convection, bicgstab,
    # saddle, pytree, latency, multigrid_mesh, newton), e.g. `--only poisson` or
    # `--only latency`
    part = lambda name: args.only in name  # noqa: E731
    b_poisson = jnp.asarray(1.0 + 0.1 * rng.standard_normal((n_poisson, n_poisson)))
    b_cd = jnp.asarray(1.0 + 0.1 * rng.standard_normal((n_cd, n_cd)))
    n_sp = 16 if args.small else 128
    b_sp = {"u": jnp.asarray(1.0 + 0.1 * rng.standard_normal((n_sp, n_sp))),
            "p": jnp.asarray(0.1 * rng.standard_normal((n_sp, n_sp)))}
    if part("poisson"):
        rows += problem(f"Poisson {n_poisson}x{n_poisson}", poisson, cg_solvers, b_poisson,
                        reference="jax.scipy cg")
    if part("convection"):
        rows += problem(f"convection-diffusion {n_cd}x{n_cd}", convection_diffusion(10.0),
                        nonsymmetric_solvers, b_cd, reference="jax.scipy gmres batched")
    sweep = bicgstab_sweep((16, 32) if args.small else (128, 512)) if part("bicgstab") else []
    if part("saddle"):
        rows += problem(f"saddle-point {n_sp}x{n_sp} x2", saddle_point, indefinite_solvers,
                        b_sp, reference="jax.scipy gmres batched")
    print(f"{'problem':28s} {'solver':30s} {'compile s':>9s} {'/jax.scipy':>10s} {'run s':>8s} "
          f"{'matvecs':>7s} {'ms/matvec':>9s} {'true rel.res':>12s} {'/fastest peer':>13s}")
    for r in rows:
        print(f"{r['problem']:28s} {r['solver']:30s} {r['compile_s']:9.3f} "
              f"{r['compile_vs_jax_scipy']:10.2f} {r['run_s']:8.3f} "
              f"{r['matvecs']:7d} {r['ms_per_matvec']:9.4f} {r['true_relative_residual']:12.2e} "
              f"{r['ratio_to_fastest_peer']:13.2f}")
    if sweep:
        print("BiCGStab on one device, convection-diffusion (time to 1e-8, interleaved medians):")
        for r in sweep:
            print(f"  {r['n']:4d}^2 strength {r['strength']:6g} (Peclet {r['peclet']:.3f}): "
                  f"solvax {r['solvax_s']:.4f} s / {r['solvax_matvecs']} matvecs, jax.scipy "
                  f"{r['jax_scipy_s']:.4f} s / {r['jax_scipy_matvecs']} matvecs: "
                  f"{r['ratio']:.2f}x")
    compiles = {leaves: pytree_compile(leaves, 64) for leaves in ((1, 4) if args.small
                                                                  else (1, 4, 16))
                if part("pytree")}
    if compiles:
        print("compile time (s) of CG with 1 / 4 / 16 pytree leaves:")
        for solver in compiles[1]:
            print(f"  {solver:14s} " + " / ".join(f"{compiles[k][solver]:.3f}"
                                                 for k in compiles))
    mesh_part = lambda name: part(name) and not ONE_DEVICE  # noqa: E731
    lat = (latency(4096) + ([] if args.small else latency(65536))) if mesh_part("latency") else []
    for r in lat:
        print(f"{r['problem']:40s} {r['solver']:36s} {r['ms_per_iteration']:8.4f} ms/it "
              f"({r['ratio_to_jax_scipy']:.2f}x jax.scipy, "
              f"{r['all_reduces_per_iteration']:g} all-reduces/it)")
    coarse = (multigrid_mesh((16,) if args.small else (64, 256))
              if mesh_part("multigrid_mesh") else [])
    for r in coarse:
        print(f"{r['problem']:36s} coarsest {r['coarse']:9s} {r['iterations']:3d} iterations "
              f"{r['solve_s']:.4f} s, {r['ms_per_iteration']:.3f} ms/it, per step "
              f"{r['per_step']}")
    newton = (benchmark_newton.defaults(args.small, [("bratu 6", 16 if args.small else 128)])
              if part("newton") else [])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "problems": rows, "bicgstab_one_device": sweep,
                       "newton": newton,
                       "pytree_compile_s": compiles,
                       "latency": lat, "multigrid_mesh": coarse}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [f"{r['problem'].split()[0]}: {r['solver']}" for r in rows]
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
        ax.barh(labels, [r["ratio_to_fastest_peer"] for r in rows],
                color=["tab:blue" if "solvax" in r["solver"] else "tab:gray" for r in rows])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("run time / fastest peer of the same method family (lower is better)")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
