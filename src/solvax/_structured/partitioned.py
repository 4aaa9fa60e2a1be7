"""Tridiagonal systems split across devices along the solve axis.

The partition (SPIKE) method: each device holds `L = n / P` consecutive rows.
With its coupling entries `a = lower[0]` (to the previous block's last unknown)
and `c = upper[L-1]` (to the next block's first unknown) dropped, its block
`A_p` is tridiagonal and is solved locally three times:

    y = A_p^{-1} f,   v = A_p^{-1} (a e_0),   w = A_p^{-1} (c e_{L-1}),

so that `x = y - v x_prev_last - w x_next_first`. The first and last rows of
that relation, over all blocks, are a reduced system in the 2P interface
unknowns; its data (six numbers per block and right-hand side) is gathered to
every device in one all-gather and solved redundantly (a 2x2-block Thomas
sweep that is lower triangular per block, P steps), after which each device
finishes its rows locally. No pivoting: the method is meant for diagonally
dominant or symmetric positive-definite systems, like the Thomas algorithm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._core import checks
from .._core.dense import mm, solve
from .._core.parallel import shard_map
from .block_tridiagonal import block_tridiagonal_solve, check_blocks
from .tridiagonal import (
    check_bands,
    expand,
    shift_down,
    shift_up,
    solver_for,
)


def _axis_size(axis_name) -> int:
    """The number of devices along `axis_name` (a static int inside `shard_map`)."""
    try:
        return lax.psum(1, axis_name)
    except NameError as e:
        raise ValueError(
            f"`axis_name` {axis_name!r} is not an axis of an enclosing `shard_map` ({e}). "
            "Under `jit`, pass `mesh=` (the solve then runs its own `shard_map`); inside "
            "`shard_map`, pass the mesh axis the leading axis is split over.") from e


def _with_halo_down(x, first):
    """`y[j] = x[j - 1]` with `y[0] = first` (the previous block's last row)."""
    return shift_down(x).at[0].set(first)


def _with_halo_up(x, last):
    """`y[j] = x[j + 1]` with `y[-1] = last` (the next block's first row)."""
    return shift_up(x).at[-1].set(last)


def _reduced_solve(data):
    """Solve the interface system for all blocks; `data[:, k]` is, per block,
    `(v_0, v_L, w_0, w_L, y_0, y_L)`: `x_0 + v_0 X_prev + w_0 X_next = y_0`,
    `x_L + v_L X_prev + w_L X_next = y_L` with `X_prev` the previous block's
    last and `X_next` the next block's first unknown. Returns `(x_0, x_L)` per block."""
    v0, vl, w0, wl, y0, yl = (data[:, k] for k in range(6))
    zero = jnp.zeros_like(y0[0])

    def forward(carry, row):
        g2_prev, t2_prev = carry  # previous block: x_L = t2 - g2 x_next
        v0, vl, w0, wl, y0, yl = row
        pivot = 1 - v0 * g2_prev
        t1 = (y0 - v0 * t2_prev) / pivot
        g1 = w0 / pivot
        t2 = yl - vl * t2_prev + vl * g2_prev * t1
        g2 = wl + vl * g2_prev * g1
        return (g2, t2), (g1, t1, g2, t2)

    _, (g1, t1, g2, t2) = lax.scan(forward, (zero, zero), (v0, vl, w0, wl, y0, yl))

    def backward(x_next_first, row):
        g1, t1, g2, t2 = row
        return t1 - g1 * x_next_first, (t1 - g1 * x_next_first, t2 - g2 * x_next_first)

    _, (x0, xl) = lax.scan(backward, zero, (g1, t1, g2, t2), reverse=True)
    return x0, xl


def _forward(lower, diag, upper, rhs, axis_name, method):
    """One partitioned solve inside `shard_map`: the local rows of `x`, the two
    neighbouring interface values, and the neighbours' coupling band entries."""
    nparts = _axis_size(axis_name)
    p = lax.axis_index(axis_name)
    rows = diag.shape[0]
    solve = solver_for(method, rhs.dtype, rows)
    ndim = rhs.ndim
    a = jnp.where(p == 0, 0, lower[0])
    c = jnp.where(p == nparts - 1, 0, upper[-1])
    y = solve(lower, diag, upper, rhs)
    unit = jnp.zeros((rows,) + a.shape, rhs.dtype)
    spikes = jnp.stack([unit.at[0].set(a), unit.at[-1].set(c)], axis=-1)
    vw = solve(lower, diag, upper, spikes)
    v, w = vw[..., 0], vw[..., 1]
    shape = y.shape[1:]
    pieces = [v[0], v[-1], w[0], w[-1], y[0], y[-1], lower[0], upper[-1]]
    local = jnp.stack([jnp.broadcast_to(expand(q, ndim - 1), shape).astype(rhs.dtype)
                       for q in pieces])
    data = lax.all_gather(local, axis_name)  # (P, 8, *shape): the one exchange
    x0, xl = _reduced_solve(data[:, :6])
    prev = jnp.maximum(p - 1, 0)
    nxt = jnp.minimum(p + 1, nparts - 1)
    x_prev = jnp.where(p == 0, 0, xl[prev])
    x_next = jnp.where(p == nparts - 1, 0, x0[nxt])
    x = y - expand(v, ndim) * x_prev[None] - expand(w, ndim) * x_next[None]
    neighbours = (jnp.where(p == 0, 0, data[prev, 7]), jnp.where(p == nparts - 1, 0, data[nxt, 6]))
    return x, (x_prev, x_next), neighbours


def _band_shaped(value, rhs_ndim, band_ndim):
    """A gathered band entry (broadcast over the rhs-only axes) back to band shape."""
    extra = rhs_ndim - band_ndim
    return value[(Ellipsis,) + (0,) * extra] if extra else value


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _partitioned(lower, diag, upper, rhs, axis_name, method):
    return _forward(lower, diag, upper, rhs, axis_name, method)[0]


@_partitioned.defjvp
def _partitioned_jvp(axis_name, method, primals, tangents):
    lower, diag, upper, rhs = primals
    dlower, ddiag, dupper, drhs = tangents
    x, (x_prev, x_next), (upper_prev, lower_next) = _forward(lower, diag, upper, rhs,
                                                            axis_name, method)
    ndim = rhs.ndim
    dA_x = (expand(dlower, ndim) * _with_halo_down(x, x_prev)
            + expand(ddiag, ndim) * x + expand(dupper, ndim) * _with_halo_up(x, x_next))
    upper_prev = _band_shaped(upper_prev, ndim, diag.ndim)
    lower_next = _band_shaped(lower_next, ndim, diag.ndim)
    lower_t = _with_halo_down(upper, upper_prev)  # bands of A^T, neighbours' entries included
    upper_t = _with_halo_up(lower, lower_next)

    def matvec(z):  # A z with a ppermute halo; traced for the transpose, never run
        nparts = _axis_size(axis_name)
        down = lax.ppermute(z[-1], axis_name, [(k, k + 1) for k in range(nparts - 1)])
        up = lax.ppermute(z[0], axis_name, [(k + 1, k) for k in range(nparts - 1)])
        return (expand(lower, ndim) * _with_halo_down(z, down) + expand(diag, ndim) * z
                + expand(upper, ndim) * _with_halo_up(z, up))

    dx = lax.custom_linear_solve(
        matvec, drhs - dA_x,
        lambda _, b: _forward(lower, diag, upper, b, axis_name, method)[0],
        lambda _, b: _forward(lower_t, diag, upper_t, b, axis_name, method)[0])
    return x, dx


def partitioned_tridiagonal_solve(lower, diag, upper, rhs, *, axis_name, mesh=None,
                                  method: str = "auto"):
    """Solve tridiagonal systems whose solve (leading) axis is split over devices.

    Same layout and meaning as `tridiagonal_solve` (row `j`:
    `lower[j] x[j-1] + diag[j] x[j] + upper[j] x[j+1] = rhs[j]`, bands
    `(n, *B)`, `rhs` `(n, *B, *K)`), but the leading axis is sharded over the
    mesh axis `axis_name` in `P` equal blocks. Each device eliminates its own
    rows, one all-gather exchanges the reduced interface system (6 values per
    block and right-hand side, independent of `n`), and each device finishes
    its rows: one collective per solve. Derivatives with respect to all four
    inputs (`jvp`, `grad`): the tangent is one more partitioned solve and the
    adjoint one partitioned solve with the transposed bands — two collectives.

    No pivoting: use it for diagonally dominant or Hermitian positive-definite
    systems (the reduced system inherits their stability); otherwise, as with
    Thomas, a zero or tiny pivot gives non-finite or inaccurate values —
    check `jnp.isfinite(x)` or the residual.

    Args:
        lower, diag, upper: bands, each `(n, *B)`.
        rhs: `(n, *B, *K)`.
        axis_name: the mesh axis the leading axis is split over.
        mesh: the mesh. With it, the function takes global arrays (use it
            under `jit`; the leading axis is sharded `P(axis_name)` inside);
            without it, it must be called inside `shard_map` on local blocks.
        method: local solver: `"thomas"`, `"lax"` or `"auto"`.

    Returns:
        `x` with the shape, dtype (and, with `mesh`, the leading-axis
        sharding) of `rhs`.

    Raises:
        ValueError: bands of different shapes, `rhs` not starting with the
            bands' shape, an unknown `method`, `n` not divisible by the number
            of devices, fewer than 2 rows per device, or (for concrete
            arrays) a sharding of `axis_name` on a non-leading axis.

    References: H. H. Wang, ACM Trans. Math. Softw. 7 (1981); E. Polizzi and
    A. Sameh, Parallel Comput. 32 (2006); K.-H. Kim et al., "PaScaL_TDMA",
    Comput. Phys. Commun. 260 (2021).
    """
    checks.check_choice("method", method, ("auto", "thomas", "lax"))
    check_bands(lower, diag, upper, rhs)
    dtype = jnp.result_type(lower, diag, upper, rhs)
    lower, diag, upper, rhs = (jnp.asarray(a, dtype) if not isinstance(a, jax.Array) else
                               a.astype(dtype) for a in (lower, diag, upper, rhs))
    _local_rows(diag.shape[0], axis_name, mesh, dict(lower=lower, diag=diag, upper=upper,
                                                     rhs=rhs), "rows", "tridiagonal_solve")
    if mesh is None:
        return _partitioned(lower, diag, upper, rhs, axis_name, method)
    spec = jax.sharding.PartitionSpec(axis_name)
    run = shard_map(lambda *a: _partitioned(*a, axis_name, method), mesh=mesh,
                    in_specs=(spec,) * 4, out_specs=spec)
    return run(lower, diag, upper, rhs)


def _local_rows(n: int, axis_name, mesh, arrays: dict, unit: str, single: str) -> int:
    """The rows per device of a partitioned solve of `n` rows (local rows
    inside `shard_map` when `mesh` is None), checked: `axis_name` an axis of
    the mesh, no array sharded over it on a non-leading axis, `n` divisible
    by the devices, at least 2 rows per device (`single` names the solve to
    use instead)."""
    if mesh is None:
        nparts, local = _axis_size(axis_name), n
    else:
        if axis_name not in mesh.axis_names:
            raise ValueError(f"`axis_name` {axis_name!r} is not an axis of the mesh "
                             f"{tuple(mesh.axis_names)}.")
        nparts = mesh.shape[axis_name]
        for name, arr in arrays.items():
            _check_leading_sharding(name, arr, axis_name)
        if n % nparts:
            raise ValueError(f"The solve axis has n = {n} {unit}, not divisible by the "
                             f"{nparts} devices of mesh axis {axis_name!r}; pad the system "
                             "(e.g. identity rows) to a multiple.")
        local = n // nparts
    if local < 2:
        raise ValueError(f"The partitioned solve needs at least 2 {unit} per device; got "
                         f"{local} (n = {local * nparts} over {nparts} devices). Use "
                         f"`{single}` without `axis_name` for such small systems.")
    return local


def _check_leading_sharding(name, arr, axis_name):
    """A concrete array must not have `axis_name` on a non-leading axis."""
    sharding = getattr(arr, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if isinstance(arr, jax.core.Tracer) or spec is None:
        return
    for axis, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if axis > 0 and axis_name in names:
            raise ValueError(
                f"`{name}` is sharded over {axis_name!r} on axis {axis} ({spec}); the "
                "partitioned solve splits the leading (solve) axis. Shard it "
                f"P({axis_name!r}, ...) or use `tridiagonal_solve` without `axis_name` "
                "(batch axes sharded: no communication).")


# ------------------------------------------------------------ block version
def _block_reduced_solve(v0, vl, w0, wl, y0, yl):
    """The interface system of the block partition method, for all partitions
    (leading axis P): `x_0 + V_0 X_prev + W_0 X_next = y_0`, `x_L + V_L X_prev
    + W_L X_next = y_L` with `m x m` spikes and `m x k` values; the same
    elimination as `_reduced_solve`, with matrices (one `m x m` solve per
    partition). Returns `(x_0, x_L)` per partition."""
    eye = jnp.eye(v0.shape[-1], dtype=v0.dtype)
    zero_g, zero_t = jnp.zeros_like(v0[0]), jnp.zeros_like(y0[0])

    def forward(carry, row):
        g2_prev, t2_prev = carry  # previous partition: x_L = t2 - g2 x_next
        v0, vl, w0, wl, y0, yl = row
        pivot = eye - mm(v0, g2_prev)
        t1 = solve(pivot, y0 - mm(v0, t2_prev))
        g1 = solve(pivot, w0)
        t2 = yl - mm(vl, t2_prev) + mm(mm(vl, g2_prev), t1)
        g2 = wl + mm(mm(vl, g2_prev), g1)
        return (g2, t2), (g1, t1, g2, t2)

    _, (g1, t1, g2, t2) = lax.scan(forward, (zero_g, zero_t), (v0, vl, w0, wl, y0, yl))

    def backward(x_next_first, row):
        g1, t1, g2, t2 = row
        x0 = t1 - mm(g1, x_next_first)
        return x0, (x0, t2 - mm(g2, x_next_first))

    _, (x0, xl) = lax.scan(backward, zero_t, (g1, t1, g2, t2), reverse=True)
    return x0, xl


def _block_forward(lower, diag, upper, rhs, axis_name):
    """One partitioned block solve inside `shard_map` (`rhs` `(L, m, k)`): the
    local rows of `x`, the neighbouring interface values and the neighbours'
    coupling blocks (for the transposed system)."""

    nparts = _axis_size(axis_name)
    p = lax.axis_index(axis_name)
    m, k = rhs.shape[1], rhs.shape[2]
    a = jnp.where(p == 0, 0, lower[0])  # couples to the previous partition's last block
    c = jnp.where(p == nparts - 1, 0, upper[-1])
    spikes = jnp.zeros(rhs.shape[:2] + (2 * m,), rhs.dtype)
    spikes = spikes.at[0, :, :m].set(a).at[-1, :, m:].set(c)
    # y, V and W in one local solve: the spikes ride along as right-hand sides
    both = block_tridiagonal_solve(lower, diag, upper, jnp.concatenate([rhs, spikes], -1))
    y, v, w = both[..., :k], both[..., k:k + m], both[..., k + m:]
    local = jnp.concatenate([v[0], v[-1], w[0], w[-1], lower[0], upper[-1], y[0], y[-1]],
                            axis=-1)  # (m, 6m + 2k)
    data = lax.all_gather(local, axis_name)  # (P, m, 6m + 2k): the one exchange
    parts = [data[..., i * m:(i + 1) * m] for i in range(6)]
    y0, yl = data[..., 6 * m:6 * m + k], data[..., 6 * m + k:]
    x0, xl = _block_reduced_solve(parts[0], parts[1], parts[2], parts[3], y0, yl)
    prev, nxt = jnp.maximum(p - 1, 0), jnp.minimum(p + 1, nparts - 1)
    x_prev = jnp.where(p == 0, 0, xl[prev])
    x_next = jnp.where(p == nparts - 1, 0, x0[nxt])
    x = y - mm(v, x_prev) - mm(w, x_next)
    neighbours = (jnp.where(p == 0, 0, parts[5][prev]),  # the previous partition's upper[-1]
                  jnp.where(p == nparts - 1, 0, parts[4][nxt]))  # the next one's lower[0]
    return x, (x_prev, x_next), neighbours


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _partitioned_block(lower, diag, upper, rhs, axis_name):
    return _block_forward(lower, diag, upper, rhs, axis_name)[0]


@_partitioned_block.defjvp
def _partitioned_block_jvp(axis_name, primals, tangents):
    lower, diag, upper, rhs = primals
    dlower, ddiag, dupper, drhs = tangents
    x, (x_prev, x_next), (upper_prev, lower_next) = _block_forward(lower, diag, upper, rhs,
                                                                  axis_name)
    dA_x = (mm(dlower, _with_halo_down(x, x_prev)) + mm(ddiag, x)
            + mm(dupper, _with_halo_up(x, x_next)))
    swap = lambda a: jnp.swapaxes(a, -1, -2)  # noqa: E731
    lower_t = swap(_with_halo_down(upper, upper_prev))  # blocks of A^T
    upper_t = swap(_with_halo_up(lower, lower_next))

    def matvec(z):  # A z with a ppermute halo; traced for the transpose, never run
        nparts = _axis_size(axis_name)
        down = lax.ppermute(z[-1], axis_name, [(q, q + 1) for q in range(nparts - 1)])
        up = lax.ppermute(z[0], axis_name, [(q + 1, q) for q in range(nparts - 1)])
        return (mm(lower, _with_halo_down(z, down)) + mm(diag, z)
                + mm(upper, _with_halo_up(z, up)))

    dx = lax.custom_linear_solve(
        matvec, drhs - dA_x,
        lambda _, b: _block_forward(lower, diag, upper, b, axis_name)[0],
        lambda _, b: _block_forward(lower_t, swap(diag), upper_t, b, axis_name)[0])
    return x, dx


def partitioned_block_tridiagonal_solve(lower, diag, upper, rhs, *, axis_name, mesh=None):
    """`block_tridiagonal_solve` with the solve (leading) axis split over devices.

    The block form of the partition (SPIKE) method of
    `partitioned_tridiagonal_solve`: each device holds `L = n / P` block rows,
    drops its two coupling blocks (`lower[0]`, to the previous device's last
    unknowns, and `upper[-1]`, to the next device's first) and solves its
    block-tridiagonal piece once for `rhs` and the `2m` spike columns together
    (one block LU). The first and last block rows of `x = y - V X_prev - W
    X_next` over all devices form the reduced system in the `2P` interface
    blocks; its data (`6 m^2 + 2 m k` numbers per device, independent of `n`)
    is exchanged in **one all-gather** and solved redundantly on every device
    (a block elimination over the `P` partitions with one `m x m` solve each),
    after which every device finishes its rows. One collective per solve;
    derivatives with respect to all four inputs cost one more partitioned
    solve each (the adjoint with the transposed blocks): two for `grad`.
    No pivoting across blocks: for block diagonally dominant or SPD systems.

    Args:
        lower, diag, upper: blocks `(n, m, m)`; `lower[0]` and `upper[-1]` unused.
        rhs: `(n, m)` or `(n, m, k)`.
        axis_name: the mesh axis the leading axis is split over.
        mesh: with it, global arrays under `jit` (the leading axis sharded
            `P(axis_name)` inside); without it, call inside `shard_map` on
            local blocks.

    Returns:
        `x` with `rhs`'s shape (and, with `mesh`, its leading-axis sharding).

    Raises:
        ValueError: as `block_tridiagonal_solve`, `n` not divisible by the
            devices, fewer than 2 block rows per device, or `axis_name` not
            an axis of the mesh.
    """

    check_blocks(lower, diag, upper)
    checks.check_vector("rhs", rhs)
    dtype = jnp.result_type(lower, diag, upper, rhs)
    lower, diag, upper, rhs = (jnp.asarray(a).astype(dtype) for a in (lower, diag, upper, rhs))
    if rhs.ndim not in (2, 3) or rhs.shape[:2] != diag.shape[:2]:
        raise ValueError(f"`rhs` must have shape (n, m) or (n, m, k) = {diag.shape[:2]} + "
                         f"(k,) to match the blocks; got {tuple(rhs.shape)}.")
    vector = rhs.ndim == 2
    rhs = rhs[..., None] if vector else rhs
    _local_rows(diag.shape[0], axis_name, mesh, dict(lower=lower, diag=diag, upper=upper,
                                                     rhs=rhs), "block rows",
                "block_tridiagonal_solve")
    if mesh is None:
        x = _partitioned_block(lower, diag, upper, rhs, axis_name)
    else:
        spec = jax.sharding.PartitionSpec(axis_name)
        x = shard_map(lambda *a: _partitioned_block(*a, axis_name), mesh=mesh,
                      in_specs=(spec,) * 4, out_specs=spec)(lower, diag, upper, rhs)
    return x[..., 0] if vector else x
