"""Krylov recycling (`sx.gcrot`, GCRO-DR) over sequences of systems.

    python benchmarks/benchmark_recycling.py [--json PATH] [--small] [--only TEXT]

One device, float64, no preconditioner unless said. Parts (`--only`):

- `sequence`: 20 backward-Euler steps (dt = 1e-2) of `u_t = div(k grad u) -
  20 u_x` on 256^2 (cell-centred, harmonic face means, first-order upwind),
  `k = 1 + 0.5 sin(2 pi (x + y) + 0.3 t)` changing every step, each solve
  to rtol 1e-8 from the previous step's solution: `gmres(restart=30)`,
  `gcrot` with its space dropped between systems ("cold") and handed on
  ("recycled"), for (m, k) = (30, 10), (40, 20) and (60, 40). Matvecs per system are
  the solve's accepted Arnoldi steps plus, for a handed-on space, the `k`
  matvecs of its refresh.
- `symmetric`: the same sequence without convection: `pcg` with Jacobi,
  alone and recycled (deflated CG, `recycle_size=k`, k = 10, 20 and 40: matvecs
  include the k that make a handed-on space A-orthonormal), against `gcrot`
  recycled.
- `adjoint`: the transposed solve of the last step's system for a loss of
  its solution, cold against handed the forward space (what `jax.grad`
  runs with `adjoint_recycle=True`).
- `symmetric_adjoint`: the transposed solve of the last symmetric step
  (pcg + Jacobi) cold, against handed the space the recycled sequence ended
  with (k = 40).
- `family`: the ledger's test bed. Backward-Euler sequences at 64^2-128^2,
  10-20 steps, slow (the coefficient's phase advances 1 per step) and fast
  (10) drift, velocity 0 (symmetric), 20 and 200 (strongly nonsymmetric:
  a handed-on space makes every solve slower there), rtol 1e-8 and 1e-5:
  total matvecs (a used space's refresh included) and time of `gcrot`
  recycled against the same `gcrot` cold, and both against gmres(30).
- `newton`: Bratu 128^2 (lambda = 6), `newton_krylov` with its default
  BiCGStab and with `solver="gcrot"` (the space handed between Newton
  steps), no preconditioner: total inner iterations and time.

`--small` runs every part on 16^2 grids and 3 steps (a smoke test).
"""

import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from problems import bratu, parse_args, run_parts, sequence_matvecs, space_used  # noqa: E402

import solvax as sx  # noqa: E402

RTOL = 1e-8
DT, VELOCITY = 1e-2, 20.0


def operator(n, t, velocity=VELOCITY):
    h = 1.0 / n
    x = (jnp.arange(n) + 0.5) * h
    X, Y = jnp.meshgrid(x, x, indexing="ij")
    D = sx.diffusion_operator(1.0 + 0.5 * jnp.sin(2 * jnp.pi * (X + Y) + 0.3 * t),
                              spacing=h, shift=1.0 / DT)
    if not velocity:
        return D

    def A(u):
        upwind = jnp.pad(u, ((1, 0), (0, 0)))[:-1]
        return D(u) + velocity * (u - upwind) / h
    return A


def initial(n):
    x = (jnp.arange(n) + 0.5) / n
    X, Y = jnp.meshgrid(x, x, indexing="ij")
    return jnp.exp(-100 * ((X - 0.3) ** 2 + (Y - 0.5) ** 2))


def _steps(small):
    return (16, 3) if small else (256, 20)


def run_sequence(n, steps, solve, recycled_k=0):
    """`(matvecs per system, seconds)` of one method over the sequence;
    `solve(t, u, space) -> (u, iterations, status, space)`, compiled before."""
    u, space, per_system = initial(n), None, []
    start = time.perf_counter()
    for i in range(steps):
        # a handed-on space costs its k refresh matvecs where it is used
        # (gcrot's ledger may run a solve cold instead)
        used = space is not None and space_used(space)
        u, its, status, space = solve(float(i), u, space)
        assert int(status) == 0, (i, int(status))
        per_system.append(int(its) + (recycled_k if used else 0))
    jax.block_until_ready(u)
    return per_system, time.perf_counter() - start


def _methods(n, velocity, m_k):
    @jax.jit
    def gmres(t, u):
        s = sx.gmres(operator(n, t, velocity), u / DT, x0=u, restart=30, rtol=RTOL)
        return s.x, s.iterations, s.status

    @jax.jit
    def pcg(t, u):
        A = operator(n, t, velocity)
        s = sx.pcg(A, u / DT, x0=u, precond=sx.jacobi(A.diagonal()), rtol=RTOL)
        return s.x, s.iterations, s.status

    def gcrot(m, k):
        @jax.jit
        def first(t, u):
            s = sx.gcrot(operator(n, t, velocity), u / DT, x0=u, m=m, k=k, rtol=RTOL)
            return s.x, s.iterations, s.status, s.recycle

        @jax.jit
        def later(t, u, space):
            s = sx.gcrot(operator(n, t, velocity), u / DT, x0=u, m=m, k=k, rtol=RTOL,
                         recycle=space)
            return s.x, s.iterations, s.status, s.recycle
        return first, later

    def deflated(k):
        @jax.jit
        def first(t, u):
            A = operator(n, t, velocity)
            s = sx.pcg(A, u / DT, x0=u, precond=sx.jacobi(A.diagonal()), rtol=RTOL,
                       recycle_size=k)
            return s.x, s.iterations, s.status, s.recycle

        @jax.jit
        def later(t, u, space):
            A = operator(n, t, velocity)
            s = sx.pcg(A, u / DT, x0=u, precond=sx.jacobi(A.diagonal()), rtol=RTOL,
                       recycle=space)
            return s.x, s.iterations, s.status, s.recycle
        return first, later

    out = {}
    if velocity:
        out["gmres(30)"] = (lambda t, u, _: (*gmres(t, u), None), 0)
    else:
        out["pcg + jacobi"] = (lambda t, u, _: (*pcg(t, u), None), 0)
        for k in (10, 20, 40):
            first, later = deflated(k)
            out[f"pcg + jacobi, recycled k={k}"] = (
                lambda t, u, s, f=first, g=later: f(t, u) if s is None else g(t, u, s), k)
    for m, k in m_k:
        first, later = gcrot(m, k)
        if velocity:
            out[f"gcrot({m},{k}) cold"] = (lambda t, u, _, f=first: f(t, u), 0)
        out[f"gcrot({m},{k}) recycled"] = (
            lambda t, u, s, f=first, g=later: f(t, u) if s is None else g(t, u, s), k)
    return out


def _part(small, velocity, m_k):
    n, steps = _steps(small)
    rows = {}
    for name, (solve, k) in _methods(n, velocity, m_k).items():
        run_sequence(n, 2, solve, k)  # compiles both the first and the later solve
        per_system, seconds = run_sequence(n, steps, solve, k)
        rows[name] = dict(matvecs=sum(per_system), per_system=per_system, seconds=seconds)
        print(f"{n}^2 x {steps} steps, {name:24s} matvecs {sum(per_system):6d}  "
              f"time {seconds:7.2f} s  per system {per_system}", flush=True)
    base = next(iter(rows))
    for name, row in rows.items():
        row["matvecs_ratio"] = row["matvecs"] / rows[base]["matvecs"]
        row["time_ratio"] = row["seconds"] / rows[base]["seconds"]
        print(f"  {name:24s} {row['matvecs_ratio']:.2f}x matvecs, {row['time_ratio']:.2f}x "
              f"time of {base}")
    return dict(n=n, steps=steps, dt=DT, velocity=velocity, rows=rows)


def sequence(small):
    return _part(small, VELOCITY, ((30, 10), (40, 20), (60, 40)))


def symmetric(small):
    return _part(small, 0.0, ((30, 10), (40, 20)))


def adjoint(small):
    n, steps = _steps(small)
    A = operator(n, float(steps - 1))
    b = initial(n) / DT
    w = jnp.cos(jnp.arange(n * n).reshape(n, n) / n)
    At = jax.linear_transpose(A, b)
    out = {}
    for m, k in ((30, 10), (40, 20), (60, 40)):
        forward = jax.jit(lambda b, m=m, k=k: sx.gcrot(A, b, m=m, k=k, rtol=RTOL))(b)
        cold = jax.jit(lambda w, m=m, k=k: sx.gcrot(lambda v: At(v)[0], w, m=m, k=k, rtol=RTOL))(w)
        warm = jax.jit(lambda w, s, m=m, k=k: sx.gcrot(lambda v: At(v)[0], w, m=m, k=k, rtol=RTOL,
                                             recycle=s))(w, forward.recycle)
        row = dict(cold=int(cold.iterations), handed=int(warm.iterations) + k)
        row["ratio"] = row["handed"] / row["cold"]
        out[f"gcrot({m},{k})"] = row
        print(f"adjoint at {n}^2, gcrot({m},{k}): cold {row['cold']} matvecs, handed the "
              f"forward space {row['handed']} ({row['ratio']:.2f}x)", flush=True)
    return out


def symmetric_adjoint(small, k=40):
    """The gradient of a loss of the last step's solution of the symmetric
    sequence: its transposed solve (pcg + Jacobi) cold, against handed the
    space the recycled sequence ended with (what `jax.grad` of a recycled
    solve runs: `k` refresh matvecs, then deflated CG)."""
    n, steps = _steps(small)
    u, space = initial(n), None
    for i in range(steps):
        A = operator(n, float(i), 0.0)
        s = sx.pcg(A, u / DT, x0=u, precond=sx.jacobi(A.diagonal()), rtol=RTOL,
                   **({"recycle_size": k} if space is None else {"recycle": space}))
        u, space = s.x, s.recycle
    w = jnp.cos(jnp.arange(n * n).reshape(n, n) / n)
    A = operator(n, float(steps - 1), 0.0)
    solve = jax.jit(lambda w, **kw: sx.pcg(A, w, precond=sx.jacobi(A.diagonal()), rtol=RTOL,
                                           **kw))
    cold = int(solve(w).iterations)
    handed = int(solve(w, recycle=space).iterations) + k
    row = dict(cold=cold, handed=handed, ratio=handed / cold, k=k)
    print(f"symmetric adjoint at {n}^2, pcg + jacobi: cold {cold} matvecs, handed the "
          f"sequence's space (k={k}) {handed} ({row['ratio']:.2f}x)", flush=True)
    return row


def newton(small):
    n = 16 if small else 128
    F, u0 = bratu(n), jnp.zeros((n, n))
    out = {}
    for name, options in (("bicgstab", {}), ("gcrot", {"solver": "gcrot"})):
        f = jax.jit(lambda u, o=options: sx.newton_krylov(F, u, rtol=RTOL, **o))
        sol = jax.block_until_ready(f(u0))
        start = time.perf_counter()
        jax.block_until_ready(f(u0).u)
        seconds = time.perf_counter() - start
        assert bool(sol.converged), name
        out[name] = dict(steps=int(sol.iterations), inner=int(sol.linear_iterations),
                         seconds=seconds)
        print(f"Bratu {n}^2 newton_krylov({name}): {int(sol.iterations)} steps, "
              f"{int(sol.linear_iterations)} inner iterations, {seconds:.3f} s", flush=True)
    out["inner_ratio"] = out["gcrot"]["inner"] / out["bicgstab"]["inner"]
    print(f"  gcrot / bicgstab inner iterations: {out['inner_ratio']:.2f}x")
    return out


FAMILY = ((64, 16, 20.0, 1.0, (30, 10), 1e-8), (96, 12, 20.0, 1.0, (60, 40), 1e-8),
          (96, 12, 200.0, 1.0, (30, 10), 1e-8), (96, 12, 200.0, 1.0, (60, 40), 1e-8),
          (96, 12, 0.0, 1.0, (30, 10), 1e-8), (128, 10, 20.0, 10.0, (30, 10), 1e-5),
          (128, 10, 200.0, 10.0, (60, 40), 1e-5), (64, 20, 0.0, 10.0, (60, 40), 1e-5))


def _member(n, steps, velocity, drift, m_k, rtol):
    """`{method: (matvecs, seconds)}` over one sequence (a second, timed pass)."""
    m, k = m_k

    @jax.jit
    def gmres(t, u, space):
        s = sx.gmres(operator(n, t, velocity), u / DT, x0=u, restart=30, rtol=rtol)
        return s.x, s.iterations, space

    @jax.jit
    def gcrot(t, u, space):
        s = sx.gcrot(operator(n, t, velocity), u / DT, x0=u, m=m, k=k, rtol=rtol, recycle=space)
        return s.x, s.iterations, s.recycle

    times = [drift * i for i in range(steps)]
    return {name: sequence_matvecs(step, initial(n), times, hand_on, k)
            for name, step, hand_on in (("gmres(30)", gmres, False), ("cold", gcrot, False),
                                        ("recycled", gcrot, True))}


def family(small):
    rows = []
    for n, steps, velocity, drift, m_k, rtol in (((16, 3, 200.0, 1.0, (10, 4), 1e-8),) if small
                                                 else FAMILY):
        o = _member(n, steps, velocity, drift, m_k, rtol)
        row = dict(n=n, steps=steps, velocity=velocity, drift=drift, m=m_k[0], k=m_k[1],
                   rtol=rtol, **{f"{name}_matvecs": v[0] for name, v in o.items()},
                   **{f"{name}_s": v[1] for name, v in o.items()})
        row["recycled_vs_cold"] = o["recycled"][0] / o["cold"][0]
        row["recycled_vs_gmres"] = o["recycled"][0] / o["gmres(30)"][0]
        row["time_recycled_vs_cold"] = o["recycled"][1] / o["cold"][1]
        print(f"{n}^2 x {steps}, velocity {velocity:g}, drift {drift:g}, gcrot{m_k}, rtol "
              f"{rtol:g}: recycled {row['recycled_vs_cold']:.3f}x cold, "
              f"{row['recycled_vs_gmres']:.3f}x gmres(30) (cold "
              f"{o['cold'][0] / o['gmres(30)'][0]:.3f}x); time {row['time_recycled_vs_cold']:.2f}x "
              "cold", flush=True)
        rows.append(row)
    return rows


def main():
    args = parse_args(__doc__)
    run_parts(args, (("sequence", sequence), ("symmetric", symmetric), ("adjoint", adjoint),
                     ("symmetric_adjoint", symmetric_adjoint), ("newton", newton),
                     ("family", family)),
              {"jax": jax.__version__, "cpu_count": os.cpu_count(), "rtol": RTOL}, args.small)


if __name__ == "__main__":
    main()
