"""A nonsymmetric problem (upwind convection–diffusion) solved with each nonsymmetric method.

    python examples/nonsymmetric.py [--n 128]

GMRES (one-sync and CGS2), BiCGStab (two and one synchronizations per step)
and IDR(s) for s = 2, 4, 8 on the same system, to rtol 1e-8 on the true
residual: steps, matvecs, synchronizations per step and the time of a warm run.
"""

import argparse
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

import solvax as sx  # noqa: E402


def convection_diffusion(strength):
    """`-Δu + c ∂u/∂x` (upwind), Dirichlet, on an n x n grid (spacing 1/(n+1))."""
    def matvec(u):
        up = jnp.pad(u, 1)
        h = 1.0 / (u.shape[0] + 1)
        lap = 4 * u - up[:-2, 1:-1] - up[2:, 1:-1] - up[1:-1, :-2] - up[1:-1, 2:]
        return lap + strength * h * (u - up[:-2, 1:-1])
    return matvec


# (solver, options, matvecs per step, reductions per step)
METHODS = {
    "gmres(30) one_sync": (sx.gmres, dict(restart=30), 1, 1),
    "gmres(30) cgs2": (sx.gmres, dict(restart=30, orthogonalization="cgs2"), 1, 2),
    "bicgstab": (sx.bicgstab, {}, 2, 2),
    "bicgstab one_sync": (sx.bicgstab, dict(method="one_sync"), 2, 1),
    "idrs s=2": (sx.idrs, dict(s=2), 1, 1),
    "idrs s=4": (sx.idrs, dict(s=4), 1, 1),
    "idrs s=8": (sx.idrs, dict(s=8), 1, 1),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=128)
    n = parser.parse_args().n
    A = convection_diffusion(10.0)
    b = jnp.ones((n, n))
    print(f"convection-diffusion {n} x {n}, rtol 1e-8")
    print(f"{'method':20s} {'status':>10s} {'steps':>6s} {'matvecs':>7s} {'syncs/step':>10s} "
          f"{'true rel. res.':>14s} {'time (s)':>8s}")
    for name, (fn, options, per_step, syncs) in METHODS.items():
        solve = jax.jit(lambda b, fn=fn, options=options: fn(A, b, rtol=1e-8, **options))
        jax.block_until_ready(solve(b))
        start = time.perf_counter()
        sol = jax.block_until_ready(solve(b))
        seconds = time.perf_counter() - start
        rel = float(jnp.linalg.norm(b - A(sol.x)) / jnp.linalg.norm(b))
        steps = int(sol.iterations)
        print(f"{name:20s} {sx.Status(int(sol.status)).name:>10s} {steps:6d} "
              f"{per_step * steps:7d} {syncs:10d} {rel:14.2e} {seconds:8.3f}")


if __name__ == "__main__":
    main()
