"""Recover a spatially varying diffusion coefficient by gradient descent through a sharded solve.

    python examples/inverse_problem.py [--n 128] [--steps 200] [--png inverse_problem.png]

Forward model: `-(k u')' = f_j` on (0, 1), Dirichlet, for three sources
`f_j`, discretized on n points with `k` on the n + 1 cell faces; the state
`u` and the coefficient are sharded over 8 emulated devices (`P('i')`).
Data: the states `u_j` for the true coefficient. Unknown: `log k`, fitted by
Adam on the misfit plus a small smoothness penalty. Every gradient goes
through `solvax.pcg` by implicit differentiation: one more CG solve (the
transposed system) per solve, never through the iteration. Saves a PNG of
the loss curve and the recovered coefficient (where matplotlib is installed).
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import solvax as sx  # noqa: E402


def operator(log_k):
    """`u -> -(k u')'` with `k = exp(log_k)` on the faces (n + 1 of them)."""
    k = jnp.exp(log_k)
    n = log_k.shape[0] - 1

    def matvec(u):
        up = jnp.pad(u, 1)
        flux = k * (up[1:] - up[:-1]) * (n + 1)  # k u' on the faces
        return -(flux[1:] - flux[:-1]) * (n + 1)

    return matvec


def states(log_k, sources):
    """The three states `u_j` (rtol 1e-10: the misfit is far below 1e-8)."""
    return [sx.pcg(operator(log_k), f, rtol=1e-10).x for f in sources]


def loss(log_k, sources, data, smoothing):
    misfit = sum(jnp.mean((u - d) ** 2) / jnp.mean(d ** 2)
                 for u, d in zip(states(log_k, sources), data))
    return misfit + smoothing * jnp.sum(jnp.diff(log_k) ** 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=128, help="a multiple of the devices (8)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--png", default="inverse_problem.png")
    args = parser.parse_args()
    n = args.n
    if n % len(jax.devices()):
        parser.error(f"--n must be a multiple of the {len(jax.devices())} devices; got {n}")
    mesh = Mesh(np.array(jax.devices()), ("i",))
    on_mesh = NamedSharding(mesh, P("i"))
    x = np.linspace(0, 1, n + 2)[1:-1]
    faces = np.linspace(0, 1, n + 1)
    true_log_k = 0.5 * np.sin(2 * np.pi * faces) + 0.3 * np.cos(5 * np.pi * faces)
    # n + 1 faces do not split evenly over the devices: the coefficient stays
    # replicated, the states and sources are sharded
    sources = [jax.device_put(jnp.asarray(f), on_mesh)
               for f in (np.ones(n), np.sin(np.pi * x), 10 * x * (1 - x) * np.cos(3 * x))]
    data = jax.jit(states)(jnp.asarray(true_log_k), sources)
    smoothing = 1e-5

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=())

    log_k = jnp.zeros(n + 1)
    m = v = jnp.zeros(n + 1)
    rate, beta1, beta2 = 0.05, 0.9, 0.999
    history = []
    for step in range(1, args.steps + 1):
        value, grad = value_and_grad(log_k, sources, data, smoothing)
        history.append(float(value))
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad ** 2
        log_k = log_k - rate * (m / (1 - beta1 ** step)) / (jnp.sqrt(v / (1 - beta2 ** step))
                                                            + 1e-12)
    error = float(jnp.max(jnp.abs(log_k - true_log_k)[n // 10: -n // 10]))
    print(f"n = {n}, {len(jax.devices())} devices, states sharded {data[0].sharding.spec}")
    print(f"loss {history[0]:.3e} -> {history[-1]:.3e} in {args.steps} Adam steps; "
          f"max |log k - true| away from the ends: {error:.3f}")
    plot(history, faces, true_log_k, np.asarray(log_k), args.png)


def plot(history, faces, true_log_k, log_k, path):
    try:
        import matplotlib
    except ModuleNotFoundError:
        print(f"no picture: {path} needs matplotlib (pip install matplotlib, or the "
              "package's [test] or [bench] extra)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.semilogy(np.arange(1, len(history) + 1), history)
    left.set_xlabel("Adam step")
    left.set_ylabel("loss (relative misfit + smoothing)")
    left.set_title("loss")
    right.plot(faces, true_log_k, "k-", label="true")
    right.plot(faces, log_k, "C1--", label="recovered")
    right.set_xlabel("x")
    right.set_ylabel("log k")
    right.set_title("diffusion coefficient")
    right.legend(loc="upper right", frameon=False)
    fig.suptitle("Gradient descent through solvax.pcg on 8 emulated CPU devices", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
