"""What the problem benchmarks share: matrix-free operators and command-line options."""

import jax.numpy as jnp
import numpy as np


def poisson(x):
    """5-point Dirichlet Laplacian on a 2-D grid (unscaled)."""
    xp = jnp.pad(x, 1)
    return 4 * x - xp[:-2, 1:-1] - xp[2:, 1:-1] - xp[1:-1, :-2] - xp[1:-1, 2:]


def cell_stencil(n: int, convection: float):
    """The 5-point entries (h = 1/n) of the cell-centred `-Laplace u + c du/dx`,
    upwind along axis 0, Dirichlet faces half a cell out (as
    `sx.diffusion_operator`: a boundary face adds `2 / h^2` to the centre);
    c = 0 is `sx.diffusion_operator(1, spacing=1/n)`."""
    h2, c = float(n * n), convection * n
    faces = np.zeros((n, n))
    faces[[0, -1], :] += 1
    faces[:, [0, -1]] += 1
    return {(0, 0): 4.0 * h2 + c + h2 * faces, (-1, 0): -h2 - c, (1, 0): -h2,
            (0, -1): -h2, (0, 1): -h2}


def cell_apply_numpy(n: int, convection: float, x: np.ndarray) -> np.ndarray:
    """The same operator in float64 NumPy (Dirichlet: zero outside)."""
    xp = np.pad(np.asarray(x, np.float64), 1)
    return sum(v * xp[1 + i:1 + i + n, 1 + j:1 + j + n]
               for (i, j), v in cell_stencil(n, convection).items())


def cell_relative_residual(n, convection, x, b) -> float:
    b = np.asarray(b, np.float64)
    r = b - cell_apply_numpy(n, convection, np.asarray(x, np.float64))
    return float(np.linalg.norm(r) / np.linalg.norm(b))


def convection_diffusion(strength=10.0):
    """Upwind convection-diffusion `-Δu + c ∂u/∂x` (axis 0), grid spacing 1/(n+1)."""

    def matvec(x):
        xp = jnp.pad(x, 1)
        h = 1.0 / (x.shape[0] + 1)
        return poisson(x) + strength * h * (x - xp[:-2, 1:-1])

    return matvec


def high_contrast(contrast=1e6):
    """`-div(k grad u)` (5-point, Dirichlet) with `k = 1` on the left half of
    the grid and `1 / contrast` on the right: SPD with condition number about
    `contrast * 4 / (pi h)^2` (1e10 on 128 x 128 for contrast 1e6)."""

    def matvec(x):
        n = x.shape[1]
        k = jnp.where(jnp.arange(n + 1) < (n + 1) // 2, 1.0, 1.0 / contrast)  # faces along axis 1
        kx = jnp.ones(x.shape[0] + 1)[:, None] * jnp.where(jnp.arange(n) < n // 2, 1.0,
                                                              1.0 / contrast)[None, :]
        xp = jnp.pad(x, 1)
        flux_y = k[None, 1:] * (x - xp[1:-1, 2:]) + k[None, :-1] * (x - xp[1:-1, :-2])
        flux_x = kx[1:] * (x - xp[2:, 1:-1]) + kx[:-1] * (x - xp[:-2, 1:-1])
        return flux_x + flux_y

    return matvec


def saddle_point(x):
    """A symmetric indefinite (saddle-point) operator on the pytree `{"u", "p"}`
    of two n x n grids: `[[K, B^T], [B, 0]]`, the KKT matrix of minimizing
    `u^T K u / 2 - f^T u` subject to `B u = g`, with K the 5-point Laplacian
    and `B = I + D / 4`, D the forward difference along axis 0 (diagonally
    dominant: the constraint is well posed for every n)."""
    u, p = x["u"], x["p"]
    zero = jnp.zeros_like(u[:1])
    bu = u + 0.25 * (jnp.concatenate([u[1:], zero]) - u)
    btp = p + 0.25 * (jnp.concatenate([zero, p[:-1]]) - p)
    return {"u": poisson(u) + btp, "p": bu}


def parse_args(doc):
    """The options every problem benchmark takes: --json, --plot, --small, --only."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="draw a PNG (needs matplotlib)")
    parser.add_argument("--small", action="store_true", help="tiny problems (a smoke test)")
    parser.add_argument("--only", metavar="TEXT", default="",
                        help="run only the solvers whose name contains TEXT")
    return parser.parse_args()


def write_json(path, out):
    """Write a benchmark's results to `path` (when given: its `--json`)."""
    import json

    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {path}")


def probe_meta() -> dict:
    """A probe's `meta`: the device, JAX's and solvax's versions, the date."""
    import time

    import jax

    import solvax as sx

    device = jax.devices()[0]
    return {"device": f"{device.platform}: {getattr(device, 'device_kind', '?')}",
            "jax": jax.__version__, "solvax": sx.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def write_probe(folder, name, result):
    """A probe's results as `folder/name` (when a folder is given: its `--out`)."""
    import os

    if folder:
        os.makedirs(folder, exist_ok=True)
        write_json(os.path.join(folder, name), result)


def run_parts(args, parts, out, small):
    """Run each `(name, part)` whose name contains `--only` (`out[name] =
    part(small)`), then write `out` to `--json`."""
    for name, part in parts:
        if args.only in name:
            out[name] = part(small)
    write_json(args.json, out)
    return out


def interleaved(fns, *args, rounds):
    """Median warm wall time (s) of each function of `fns` (name -> fn),
    jitted, on `args`: `rounds` rounds that run every function once in turn
    (this machine drifts by 10-30 % within a minute: run one after the
    other, the first measured slowest)."""
    import statistics
    import time

    import jax

    compiled = {name: jax.jit(fn) for name, fn in fns.items()}
    for fn in compiled.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def space_used(space) -> bool:
    """Whether a solve handed the recycled `space` refreshes and uses it (and
    so spends its `k` refresh matvecs): `gcrot`'s ledger decides; a space
    without one (deflated CG's, or one given by hand) always is."""
    import solvax as sx

    return bool(sx._krylov.recycling.worth_refreshing(getattr(space, "ledger", None)))


def sequence_matvecs(step, u0, times, hand_on: bool, k: int):
    """`(matvecs, seconds)` of a sequence of solves, each from the last one's
    answer: `step(t, u, space) -> (u, iterations, space)` at each `t` of
    `times`, handing the returned recycled space to the next solve where
    `hand_on` (a space the ledger uses costs its `k` refresh matvecs,
    `space_used`). Run twice: the first pass compiles, the second is timed."""
    import time

    import jax

    for _ in range(2):
        u, space, matvecs = u0, None, 0
        start = time.perf_counter()
        for t in times:
            given = space if hand_on else None
            used = given is not None and space_used(given)
            u, its, space = step(t, u, given)
            matvecs += int(its) + (k if used else 0)
        jax.block_until_ready(u)
        seconds = time.perf_counter() - start
    return matvecs, seconds


def median_time(fn, *args, repeats=5):
    """Median wall time (s) of `repeats` warm runs of `jax.jit(fn)(*args)`
    (the first call, which compiles, is not timed); `fn` already compiled
    (a `jax.stages.Compiled`) runs as it is."""
    import statistics
    import time

    import jax

    compiled = fn if isinstance(fn, jax.stages.Compiled) else jax.jit(fn)
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def latency_problem(n, sharding):
    """The latency-bound mesh's system, placed with `sharding`: a diagonal
    operator `d` with a spread spectrum (condition 1e4, so no variant
    converges or breaks down within a few hundred steps) and `b` of ones."""
    import jax
    import numpy as np

    d = jax.device_put(jnp.asarray(1.0 + 1e4 * np.arange(n) / n), sharding)
    return d, jax.device_put(jnp.ones(n), sharding)


# ------------------------------------------------ nonlinear problems (Newton)
def laplacian(u, h, xp=jnp):
    """`-Δu` (5-point)."""
    up = xp.pad(u, 1)
    return (4 * u - up[2:, 1:-1] - up[:-2, 1:-1] - up[1:-1, 2:] - up[1:-1, :-2]) / h**2


def bratu(n, lam=6.0, xp=jnp):
    """`F(u) = -Δu - λ e^u` (Bratu; no solution past λ* ≈ 6.81)."""
    h = 1.0 / (n + 1)
    return lambda u: laplacian(u, h, xp) - lam * xp.exp(u)


def nonlinear_convection(n, c=20.0, f=100.0, xp=jnp):
    """`F(u) = -div((1 + u^2) grad u) + c ∂u/∂x - f` (upwind convection along
    axis 0, face coefficients the mean of the two cells): nonsymmetric; from
    `u = 0` the full Newton step overshoots (the line search shortens it)."""
    h = 1.0 / (n + 1)

    def F(u):
        up = xp.pad(u, 1)
        k = 1 + up**2
        kx = 0.5 * (k[1:, 1:-1] + k[:-1, 1:-1])
        ky = 0.5 * (k[1:-1, 1:] + k[1:-1, :-1])
        gx = (up[1:, 1:-1] - up[:-1, 1:-1]) / h
        gy = (up[1:-1, 1:] - up[1:-1, :-1]) / h
        div = (kx[1:] * gx[1:] - kx[:-1] * gx[:-1] + ky[:, 1:] * gy[:, 1:]
               - ky[:, :-1] * gy[:, :-1]) / h
        return -div + c * (u - up[:-2, 1:-1]) / h - f

    return F


def bratu_multigrid(n, lam=6.0, dtype=jnp.float64):
    """`u -> multigrid of the Bratu Jacobian -Δ - λ e^u at u` (a `precond_builder`);
    `dtype=jnp.float32`: the hierarchy and its cycle in single precision."""
    import solvax as sx

    h = 1.0 / (n + 1)

    def build(u):
        jacobian = sx.diffusion_operator(1.0, shape=u.shape, spacing=h, shift=-lam * jnp.exp(u))
        return sx.multigrid(jacobian, dtype=None if dtype == u.dtype else dtype)

    return build
