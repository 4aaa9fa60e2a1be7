"""Mixed precision: float64 answers from float32 work.

    python benchmarks/benchmark_precision.py [--json PATH] [--small] [--only TEXT]

One device. Parts (`--only`):

- `poisson`: Poisson 1024^2 (cell-centred, Dirichlet), multigrid-preconditioned,
  to a float64 true relative residual of 1e-12, set-up included (medians of
  15 interleaved rounds, each program once per round): all-float64 MG-CG; float64 CG
  with the float32 cycle (`multigrid(A, dtype=jnp.float32)`); and
  `iterative_refinement` with float32 MG-CG corrections at inner tolerances
  1e-3, 1e-4 (the default) and 1e-6.
- `storage`: 3-D diffusion 96^3 with cell-wise coefficients `10^(3 u)`, `u`
  uniform (contrast 1e3), float64 CG to 1e-8 preconditioned by the float32
  multigrid cycle with its hierarchy stored in float32 and bfloat16
  (`storage_dtype`): iterations and time, set-up included and with the
  hierarchy built once and passed in (the solve alone; medians of 9
  interleaved rounds). (float16 cannot hold this hierarchy: its coarsest
  coefficients reach 3e6; refused.)
- `kappa`: diagonal-plus-Laplacian operators of condition number 1e2 to
  1e12 (n = 256), refinement with float32 GMRES corrections to 1e-12: the
  status, steps and true residual beside the bound kappa * 6e-8 < 0.5.

`--small` runs 64^2, 16^3 and n = 64 (a smoke test).
"""

import functools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from problems import interleaved, parse_args, run_parts  # noqa: E402

import solvax as sx  # noqa: E402

RTOL = 1e-12


def poisson(small):
    n = 64 if small else 1024
    k = jnp.ones((n, n))
    b = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)))

    def mg_cg(k, b, dtype=None):
        A = sx.diffusion_operator(k)
        return sx.pcg(A, b, precond=sx.multigrid(A, dtype=dtype), rtol=RTOL, atol=0.0)

    def refinement(k, b, inner_rtol):
        A = sx.diffusion_operator(k)
        return sx.iterative_refinement(A, b, precond=sx.multigrid(A, dtype=jnp.float32),
                                       rtol=RTOL, inner_rtol=inner_rtol)

    cases = {"float64 MG-CG": mg_cg,
             "float64 CG, float32 cycle": functools.partial(mg_cg, dtype=jnp.float32)}
    for inner in (1e-3, 1e-4, 1e-6):
        cases[f"refinement, float32 MG-CG to {inner:.0e}"] = functools.partial(
            refinement, inner_rtol=inner)
    A = sx.diffusion_operator(k)
    times = interleaved({name: lambda k, b, f=fn: f(k, b).x for name, fn in cases.items()},
                        k, b, rounds=3 if small else 15)
    rows = {}
    for name, fn in cases.items():
        sol = jax.jit(fn)(k, b)
        true = float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b))
        rows[name] = dict(status=sx.Status(int(sol.status)).name,
                          iterations=int(sol.iterations), true_relative_residual=true,
                          time_s=times[name], vs_float64=times[name] / times["float64 MG-CG"])
        r = rows[name]
        print(f"Poisson {n}^2 {name:40s} {r['time_s']:.3f} s ({r['vs_float64']:.2f}x)  "
              f"{r['iterations']:3d} its  {r['status']}  true {r['true_relative_residual']:.1e}",
              flush=True)
    return dict(n=n, rtol=RTOL, rounds=3 if small else 15, rows=rows)


def storage(small):
    n = 16 if small else 96
    rng = np.random.default_rng(2)
    k = jnp.asarray(10.0 ** (3 * rng.random((n, n, n))))
    b = jnp.asarray(rng.standard_normal((n, n, n)))
    A = sx.diffusion_operator(k)

    def hierarchy(A, name):
        return sx.multigrid(A, dtype=jnp.float32, storage_dtype=jnp.dtype(name))

    def solve(k, b, name):   # set-up included
        A = sx.diffusion_operator(k)
        return sx.pcg(A, b, precond=hierarchy(A, name), rtol=1e-8, atol=0.0)

    def built_once(k, b, mg):   # the hierarchy passed in: the solve alone
        return sx.pcg(sx.diffusion_operator(k), b, precond=mg, rtol=1e-8, atol=0.0)

    names = ("float32", "bfloat16")
    built = {name: jax.jit(lambda k, name=name: hierarchy(sx.diffusion_operator(k), name))(k)
             for name in names}
    fns = {name: lambda k, b, name=name: solve(k, b, name).x for name in names}
    fns.update({f"{name}, built once": lambda k, b, name=name: built_once(k, b, built[name]).x
                for name in names})
    times = interleaved(fns, k, b, rounds=3 if small else 9)
    rows = {}
    for name in names:
        sol = jax.jit(functools.partial(solve, name=name))(k, b)
        true = float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b))
        once = times[f"{name}, built once"]
        rows[name] = dict(status=sx.Status(int(sol.status)).name, iterations=int(sol.iterations),
                          true_relative_residual=true, time_s=times[name],
                          vs_float32=times[name] / times["float32"], built_once_s=once,
                          built_once_vs_float32=once / times["float32, built once"])
        r = rows[name]
        print(f"{n}^3 contrast 1e3, hierarchy stored in {name:8s}: {r['iterations']:3d} its "
              f"{r['time_s']:.3f} s ({r['vs_float32']:.2f}x)  {r['status']}  true "
              f"{true:.1e};  built once: {once:.3f} s ({r['built_once_vs_float32']:.2f}x)",
              flush=True)
    return dict(n=n, rows=rows)


def kappa(small):
    n = 64 if small else 256
    rng = np.random.default_rng(1)
    b = jnp.asarray(rng.standard_normal(n))
    rows = []
    for exponent in range(2, 13, 2):
        d = jnp.logspace(0, exponent, n)

        def A(x, d=d):
            lap = 2 * x - jnp.pad(x[1:], (0, 1)) - jnp.pad(x[:-1], (1, 0))
            return d * x + 1e-3 * lap

        sol = sx.iterative_refinement(A, b, solver=functools.partial(sx.gmres, restart=n),
                                      rtol=RTOL)
        true = float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b))
        row = dict(kappa=10.0 ** exponent, resolvable=10.0 ** exponent * 6e-8 < 0.5,
                   status=sx.Status(int(sol.status)).name, steps=int(sol.iterations),
                   true_relative_residual=true)
        rows.append(row)
        print(f"kappa 1e{exponent:<2d} (kappa u {'<' if row['resolvable'] else '>='} 0.5): "
              f"{row['status']:11s} {row['steps']:2d} steps, true {true:.1e}", flush=True)
    return rows


def main():
    args = parse_args(__doc__)
    run_parts(args, [("poisson", poisson), ("storage", storage), ("kappa", kappa)], {},
              args.small)


if __name__ == "__main__":
    main()
