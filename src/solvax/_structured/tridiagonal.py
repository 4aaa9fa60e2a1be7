"""Batched tridiagonal solves along the leading axis, plain and cyclic (periodic)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._core import checks

METHOD_NAMES = ("auto", "thomas", "lax")


def shift_down(x):
    """`y[j] = x[j - 1]`, `y[0] = 0` along the leading axis."""
    return jnp.pad(x[:-1], [(1, 0)] + [(0, 0)] * (x.ndim - 1))


def shift_up(x):
    """`y[j] = x[j + 1]`, `y[-1] = 0` along the leading axis."""
    return jnp.pad(x[1:], [(0, 1)] + [(0, 0)] * (x.ndim - 1))


def expand(band, ndim):
    """Append unit axes so a band broadcasts against an `ndim`-dimensional rhs."""
    return lax.expand_dims(band, tuple(range(band.ndim, ndim))) if band.ndim < ndim else band


def _matvec(lower, diag, upper, x):
    lower, diag, upper = (expand(band, x.ndim) for band in (lower, diag, upper))
    return lower * shift_down(x) + diag * x + upper * shift_up(x)


def _transposed(lower, diag, upper):
    """Bands of `A^T`: `lower'[j] = upper[j - 1]`, `upper'[j] = lower[j + 1]`."""
    return shift_down(upper), diag, shift_up(lower)


def _thomas(lower, diag, upper, rhs):
    """Thomas elimination with `lax.scan`: forward sweep, then back substitution."""
    lower, diag, upper = (expand(band, rhs.ndim) for band in (lower, diag, upper))
    dtype = rhs.dtype
    # from the operands, so the carry has their type (varying inside shard_map)
    zero = jnp.zeros_like(jnp.broadcast_arrays(upper[0], rhs[0])[0], dtype)

    def forward(carry, row):
        c_prev, y_prev = carry
        l, d, u, r = row
        denom = d - l * c_prev
        c = u / denom
        y = (r - l * y_prev) / denom
        return (c, y), (c, y)

    _, (c, y) = lax.scan(forward, (zero, zero), (lower, diag, upper, rhs))

    def backward(x_next, row):
        c_j, y_j = row
        x = y_j - c_j * x_next
        return x, x

    _, x = lax.scan(backward, zero, (c, y), reverse=True)
    return x.astype(dtype)


def _lax(lower, diag, upper, rhs):
    """`lax.linalg.tridiagonal_solve` (LAPACK gtsv / cuSPARSE) in our layout."""
    lower = lower.at[0].set(0)
    upper = upper.at[-1].set(0)
    if lower.ndim == 1 and rhs.ndim <= 2:  # one matrix, the trailing axis are its rhs
        b = rhs if rhs.ndim == 2 else rhs[:, None]
        x = lax.linalg.tridiagonal_solve(lower, diag, upper, b)
        return x if rhs.ndim == 2 else x[:, 0]
    # One matrix per batch entry: move the system axis last (local transposes only).
    bands = [jnp.moveaxis(jnp.broadcast_to(expand(band, rhs.ndim), rhs.shape), 0, -1)
             for band in (lower, diag, upper)]
    x = lax.linalg.tridiagonal_solve(*bands, jnp.moveaxis(rhs, 0, -1)[..., None])
    return jnp.moveaxis(x[..., 0], -1, 0)


@functools.cache
def lax_supports(dtype, n: int) -> bool:
    """Whether this JAX's `lax.linalg.tridiagonal_solve` takes `dtype` and `n` rows
    (JAX 0.4.x: real dtypes and n >= 3 only)."""
    try:
        z = jax.ShapeDtypeStruct((n,), dtype)
        jax.eval_shape(lax.linalg.tridiagonal_solve, z, z, z, jax.ShapeDtypeStruct((n, 1), dtype))
    except (ValueError, TypeError, NotImplementedError):
        return False
    return True


def solver_for(method: str, dtype, rows: int):
    """The elimination routine `method` names for this dtype and system size
    (`"auto"`: LAPACK where this JAX supports it, else Thomas)."""
    supported = lax_supports(jnp.dtype(dtype), rows)
    if method == "auto":
        method = "lax" if supported else "thomas"
    elif method == "lax" and not supported:
        raise ValueError(f"`method='lax'`: this JAX's `lax.linalg.tridiagonal_solve` does not "
                         f"support dtype {jnp.dtype(dtype).name} with n = {rows} rows; "
                         "use method='thomas' or 'auto'.")
    return _thomas if method == "thomas" else _lax


def check_bands(lower, diag, upper, rhs):
    for name, band in (("lower", lower), ("diag", diag), ("upper", upper), ("rhs", rhs)):
        checks.check_vector(name, band)
        if jnp.finfo(band.dtype).bits < 32:
            raise TypeError(f"`{name}` is {jnp.dtype(band.dtype).name}; the tridiagonal "
                            "solves need float32 or wider (XLA has no 16-bit tridiagonal "
                            f"solve, and elimination in 16 bits loses most digits). Cast it, "
                            f"e.g. `{name}.astype(jnp.float32)`.")
    shapes = {name: tuple(band.shape) for name, band in
              (("lower", lower), ("diag", diag), ("upper", upper))}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"`lower`, `diag` and `upper` must have the same shape; got {shapes}.")
    shape = shapes["diag"]
    if len(shape) == 0 or shape[0] < 1:
        raise ValueError(f"The bands need a leading system axis of length >= 1; got shape {shape}.")
    if tuple(rhs.shape[: len(shape)]) != shape:
        raise ValueError(
            f"`rhs` of shape {tuple(rhs.shape)} must start with the bands' shape {shape}: the "
            "system lies on the leading axis and any further `rhs` axes are independent "
            "right-hand sides (give bands of shape (n,) to share one matrix).")


def tridiagonal_solve(lower, diag, upper, rhs, *, method: str = "auto"):
    """Solve tridiagonal systems along the leading axis, batched over trailing axes.

    Row `j` reads `lower[j] x[j-1] + diag[j] x[j] + upper[j] x[j+1] = rhs[j]`;
    `lower[0]` and `upper[-1]` are unused, whatever they hold (NaN or Inf
    there changes nothing; their gradients are 0). The bands have shape `(n, *B)`,
    a prefix of `rhs.shape = (n, *B, *K)`: each index of `B` is its own matrix,
    each index of `K` another right-hand side for it. Every trailing axis is
    independent, so sharding any of them costs no communication.

    Thomas algorithm (no pivoting; stable for diagonally dominant or SPD
    matrices): `c'_j = u_j / (d_j - l_j c'_{j-1})`,
    `y_j = (r_j - l_j y_{j-1}) / (d_j - l_j c'_{j-1})`, then
    `x_j = y_j - c'_j x_{j+1}`. A pivot `d_j - l_j c'_{j-1}` that is exactly
    zero (a singular matrix, or a nonsingular one that needs pivoting, e.g.
    `diag[0] = 0`) gives Inf/NaN in the solution from that row on; `"lax"`
    (partial pivoting on the CPU) solves the nonsingular ones.

    Differentiable with respect to all four inputs (`grad`, `jvp`, `vmap`)
    through `lax.custom_linear_solve`: the tangent is one more solve, and the
    adjoint is one solve with the transposed bands
    (`lower'[j] = upper[j-1]`, `upper'[j] = lower[j+1]`), columnwise like the
    primal, hence collective-free when the batch axes are sharded.

    Args:
        lower, diag, upper: the bands, each of shape `(n, *B)`, real or complex.
        rhs: right-hand sides of shape `(n, *B, *K)`.
        method: `"thomas"` (a `lax.scan`, any dtype/backend), `"lax"`
            (`lax.linalg.tridiagonal_solve`: LAPACK `gtsv` with partial
            pivoting on CPU, cuSPARSE on GPU) or `"auto"` (`"lax"` where this
            JAX supports the dtype and size — JAX 0.4.x has no complex `lax`
            solve and needs n >= 3 — else `"thomas"`).

    Returns:
        `x` with the shape and dtype of `rhs`.

    Raises:
        ValueError: bands of different shapes, a band shape that is not a
            prefix of `rhs.shape`, an empty system, an unknown `method`, or
            `method="lax"` for a dtype this JAX's `lax` solve does not take.
        TypeError: non-floating inputs.

    Reference: L. H. Thomas, "Elliptic problems in linear difference
    equations over a network", Watson Sci. Comput. Lab. report (1949).
    """
    checks.check_choice("method", method, METHOD_NAMES)
    check_bands(lower, diag, upper, rhs)
    dtype = jnp.result_type(lower, diag, upper, rhs)
    lower, diag, upper, rhs = (jnp.asarray(a, dtype) for a in (lower, diag, upper, rhs))
    lower, upper = lower.at[0].set(0), upper.at[-1].set(0)  # unused, whatever they hold
    solve = solver_for(method, dtype, int(diag.shape[0]))

    def primal(_, b):
        return solve(lower, diag, upper, b)

    def transpose(_, b):
        return solve(*_transposed(lower, diag, upper), b)

    return lax.custom_linear_solve(
        functools.partial(_matvec, lower, diag, upper), rhs, primal, transpose)


__all__ = ["tridiagonal_solve", "METHOD_NAMES"]


def cyclic_tridiagonal_solve(lower, diag, upper, rhs, *, method: str = "auto"):
    """Solve periodic tridiagonal systems: `lower[0]` couples row 0 to `x[n-1]`
    and `upper[-1]` couples row `n-1` to `x[0]`.

    Sherman–Morrison on top of `tridiagonal_solve`: with a shift `gamma`,
    `u = (gamma, 0, ..., 0, upper[-1])`, `v = (1, 0, ..., 0, lower[0] / gamma)`,
    the matrix is `A' + u v^T` where `A'` is tridiagonal with
    `diag'[0] = diag[0] - gamma` and `diag'[-1] = diag[-1] - upper[-1] lower[0] / gamma`;
    then `x = y - (v.y / (1 + v.z)) z` with `A' y = rhs`, `A' z = u`. The shift
    is `gamma = -sign(diag[0]) max(|diag[0]|, sqrt(|upper[-1] lower[0]|))`
    (Numerical Recipes' `-diag[0]` where that is the larger): never zero for a
    system with a nonzero corner, so `diag[0] = 0` does not divide by zero,
    and never so small that the corner term `upper[-1] lower[0] / gamma`
    swamps `diag[-1]`. Everything
    is per batch entry (the dot products are over the local system axis), so a
    sharded batch axis costs no communication, forward or reverse, and the
    derivative comes from the two tridiagonal solves.

    Args:
        lower, diag, upper: bands `(n, *B)`, `n >= 3`; `lower[0]` and
            `upper[-1]` are the corner entries.
        rhs: `(n, *B, *K)`.
        method: as for `tridiagonal_solve`.

    Returns:
        `x` with the shape and dtype of `rhs`.

    Raises:
        ValueError: as `tridiagonal_solve`, or `n < 3`.

    Reference: W. H. Press et al., Numerical Recipes, 3rd ed., sec. 2.7.2.
    """
    check_bands(lower, diag, upper, rhs)
    if diag.shape[0] < 3:
        raise ValueError(f"`cyclic_tridiagonal_solve` needs n >= 3 rows; got {diag.shape[0]}.")
    dtype = jnp.result_type(lower, diag, upper, rhs)
    lower, diag, upper, rhs = (jnp.asarray(a, dtype) for a in (lower, diag, upper, rhs))
    alpha, beta = upper[-1], lower[0]  # A[n-1, 0] and A[0, n-1]
    corner = jnp.sqrt(jnp.abs(alpha * beta))
    size = jnp.maximum(jnp.abs(diag[0]), corner)
    sign = jnp.where(diag[0] == 0, 1, jnp.sign(diag[0]))
    gamma = -sign * jnp.where(size > 0, size, 1).astype(dtype)
    diag_mod = diag.at[0].add(-gamma).at[-1].add(-alpha * beta / gamma)
    u = jnp.zeros_like(diag).at[0].set(gamma).at[-1].set(alpha)
    y = tridiagonal_solve(lower, diag_mod, upper, rhs, method=method)
    z = tridiagonal_solve(lower, diag_mod, upper, u, method=method)
    ndim = rhs.ndim

    def v_dot(t):  # v.t over the system axis, per batch entry
        return t[0] + expand(beta / gamma, t.ndim - 1) * t[-1]

    factor = v_dot(y) / expand(1 + v_dot(z), ndim - 1)
    return y - expand(z, ndim) * factor[None]

