"""Block-tridiagonal and banded direct solves: block LU along the leading axis.

Row block `j` reads `L_j x_{j-1} + D_j x_j + U_j x_{j+1} = r_j` with `m x m`
blocks. Block elimination without pivoting *between* blocks, each pivot block
factored with partial pivoting (`dense.lu_factor`), writes `A = L^ U^`:

    L^ = block lower bidiagonal: S_j on the diagonal, L_j below,
    U^ = block upper bidiagonal: I on the diagonal, C_j above,
    S_0 = D_0,  C_j = S_j^{-1} U_j,  S_j = D_j - L_j C_{j-1},

so `A x = r` is `S_j y_j = r_j - L_j y_{j-1}` (forward) and `x_j = y_j - C_j
x_{j+1}` (backward), and `A^T z = r` reuses the same factors: `U^^T w = r`
(`w_j = r_j - C_{j-1}^T w_{j-1}`), then `L^^T z = w` (`S_j^T z_j = w_j -
L_{j+1}^T z_{j+1}`). One factorization serves every right-hand side and the
adjoint. Stable where block Thomas is: block diagonally dominant or
symmetric positive-definite matrices (no pivoting across blocks). Every loop
is a `lax.scan` over the blocks, so the compile time does not grow with `n`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._core import checks
from .._core.dense import lu_factor, lu_solve, mm, solve
from .tridiagonal import shift_down, shift_up


class BlockTridiagonalFactors(NamedTuple):
    """The block LU factors of a block-tridiagonal matrix (`block_tridiagonal_factor`).

    A pytree: pass it through `jit`, `vmap` (one factorization per batch
    entry) and to `block_tridiagonal_solve_factored`. `lower`, `diag` and
    `upper` are the blocks themselves (unused entries zeroed), through which
    solves are differentiated; `lu`, `pivots` and `C` are the factors.
    """

    lower: jax.Array  # (n, m, m)
    diag: jax.Array
    upper: jax.Array
    lu: jax.Array  # (n, m, m): LU of the pivot blocks S_j (packed: L below the diagonal)
    pivots: jax.Array  # (n, m): each pivot block's row permutation (`dense.lu_factor`)
    C: jax.Array  # (n, m, m): S_j^{-1} U_j


def check_blocks(lower, diag, upper):
    for name, band in (("lower", lower), ("diag", diag), ("upper", upper)):
        checks.check_vector(name, band)
    shapes = {name: tuple(jnp.shape(band)) for name, band in
              (("lower", lower), ("diag", diag), ("upper", upper))}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"`lower`, `diag` and `upper` must have the same shape (n, m, m); "
                         f"got {shapes}.")
    shape = shapes["diag"]
    if len(shape) != 3 or shape[0] < 1 or shape[1] != shape[2] or shape[1] < 1:
        raise ValueError(f"The blocks must have shape (n, m, m): n >= 1 square m x m blocks "
                         f"along the leading axis; got {shape}. (Batch with `jax.vmap`.)")


def _check_rhs(rhs, n: int, m: int):
    checks.check_vector("rhs", rhs)
    if jnp.ndim(rhs) < 2 or tuple(jnp.shape(rhs)[:2]) != (n, m):
        raise ValueError(f"`rhs` must have shape (n, m) or (n, m, k) = ({n}, {m}, ...) to "
                         f"match the blocks; got {tuple(jnp.shape(rhs))}.")


def block_tridiagonal_factor(lower, diag, upper) -> BlockTridiagonalFactors:
    """Factor a block-tridiagonal matrix once, for many solves.

    Args:
        lower, diag, upper: blocks of shape `(n, m, m)`, real or complex:
            row block `j` is `lower[j] x[j-1] + diag[j] x[j] + upper[j] x[j+1]`;
            `lower[0]` and `upper[-1]` are unused, whatever they hold.

    Returns:
        `BlockTridiagonalFactors` for `block_tridiagonal_solve_factored`.

    Raises:
        ValueError: blocks of different or non-square shapes, or `n < 1`.
        TypeError: non-floating blocks.

    A singular pivot block (a singular matrix, or one that needs pivoting
    across blocks) gives Inf/NaN in the factors, and every solve with them
    returns Inf/NaN from that block on: check `jnp.isfinite` of the result
    where that can happen.
    """
    check_blocks(lower, diag, upper)
    dtype = jnp.result_type(lower, diag, upper)
    lower, diag, upper = (jnp.asarray(a, dtype) for a in (lower, diag, upper))
    lower, upper = lower.at[0].set(0), upper.at[-1].set(0)  # unused, whatever they hold

    def step(C_prev, row):
        L, D, U = row
        S = D - mm(L, C_prev)
        lu, piv = lu_factor(S)
        C = lu_solve((lu, piv), U)
        return C, (lu, piv, C)

    zero = jnp.zeros_like(diag[0])
    _, (lu, piv, C) = lax.scan(step, zero, (lower, diag, upper))
    return BlockTridiagonalFactors(lower, diag, upper, lu, piv, C)


def _as_matrix_rhs(rhs):
    """`(n, m, k)` view of an `(n, m, *K)` right-hand side."""
    return rhs.reshape(rhs.shape[:2] + (-1,))


def _solve(f: BlockTridiagonalFactors, rhs):
    """`A^{-1} rhs` for `rhs` of shape `(n, m, k)`: forward, then backward sweep."""
    def forward(y_prev, row):
        lu, piv, L, r = row
        y = lu_solve((lu, piv), r - mm(L, y_prev))
        return y, y

    zero = jnp.zeros_like(rhs[0])
    _, y = lax.scan(forward, zero, (f.lu, f.pivots, f.lower, rhs))

    def backward(x_next, row):
        C, y = row
        x = y - mm(C, x_next)
        return x, x

    _, x = lax.scan(backward, zero, (f.C, y), reverse=True)
    return x


def _solve_transposed(f: BlockTridiagonalFactors, rhs):
    """`A^{-T} rhs` (plain transpose, also for complex) with the same factors."""
    def forward(w_prev, row):
        C_prev, r = row
        w = r - mm(C_prev.T, w_prev)
        return w, w

    zero = jnp.zeros_like(rhs[0])
    C_prev = shift_down(f.C)
    _, w = lax.scan(forward, zero, (C_prev, rhs))
    L_next = shift_up(f.lower)

    def backward(z_next, row):
        lu, piv, L, w = row
        z = lu_solve((lu, piv), w - mm(L.T, z_next), trans=True)
        return z, z

    _, z = lax.scan(backward, zero, (f.lu, f.pivots, L_next, w), reverse=True)
    return z


def _matvec(f: BlockTridiagonalFactors, x):
    return mm(f.lower, shift_down(x)) + mm(f.diag, x) + mm(f.upper, shift_up(x))


def block_tridiagonal_solve_factored(factors: BlockTridiagonalFactors, rhs):
    """Solve `A x = rhs` with the factors of `block_tridiagonal_factor`.

    Args:
        factors: from `block_tridiagonal_factor(lower, diag, upper)`.
        rhs: `(n, m)` or `(n, m, *K)` (each trailing index another right-hand side).

    Returns:
        `x` with `rhs`'s shape, in the common dtype.

    Differentiable with respect to `rhs` and to the blocks the factors were
    made from (`lax.custom_linear_solve`): the tangent is one more solve, the
    adjoint one solve with `A^T` using the same factors (no second
    factorization).
    """
    if not isinstance(factors, BlockTridiagonalFactors):
        raise TypeError("`factors` must come from `block_tridiagonal_factor`; got "
                        f"{type(factors).__name__}.")
    n, m = factors.diag.shape[:2]
    _check_rhs(rhs, n, m)
    dtype = jnp.result_type(factors.diag, rhs)
    factors = BlockTridiagonalFactors(*(a.astype(dtype) if jnp.issubdtype(
        a.dtype, jnp.inexact) else a for a in factors))
    shape = jnp.shape(rhs)
    b = _as_matrix_rhs(jnp.asarray(rhs, dtype))
    x = lax.custom_linear_solve(functools.partial(_matvec, factors), b,
                                lambda _, r: _solve(factors, r),
                                lambda _, r: _solve_transposed(factors, r))
    return x.reshape(shape)


def block_tridiagonal_solve(lower, diag, upper, rhs):
    """Solve a block-tridiagonal system `A x = rhs` by block LU (module docstring).

    Args:
        lower, diag, upper: blocks `(n, m, m)`, real or complex, float32 or
            float64; `lower[0]` and `upper[-1]` are unused, whatever they hold.
        rhs: `(n, m)` or `(n, m, *K)`.

    Returns:
        `x` with `rhs`'s shape, in the common dtype.

    Raises:
        ValueError: mismatched or non-square blocks, or an `rhs` whose leading
            shape is not `(n, m)`. TypeError: non-floating inputs.

    Batch independent systems with `jax.vmap` (a sharded batch axis costs no
    communication, forward or reverse). Differentiable with respect to all
    four inputs; reuse one matrix for many right-hand sides with
    `block_tridiagonal_factor` and `block_tridiagonal_solve_factored`. A
    singular pivot block gives Inf/NaN from that block on.
    """
    check_blocks(lower, diag, upper)
    _check_rhs(rhs, diag.shape[0], diag.shape[1])
    return block_tridiagonal_solve_factored(block_tridiagonal_factor(lower, diag, upper), rhs)


def _band_blocks(ab, lower_bandwidth: int, upper_bandwidth: int, m: int, nblocks: int,
                 periodic: bool = False):
    """The `(nblocks, m, m)` lower, diagonal and upper blocks of the matrix
    whose `scipy.linalg.solve_banded` storage is `ab` (`a[i, j] = ab[u + i - j,
    j]`), padded with identity rows to `nblocks * m`: gathers with static
    indices. `periodic`: columns wrap around (`n = nblocks * m`), so
    `lower[0]` and `upper[-1]` are the corner blocks."""
    import numpy as np

    n = ab.shape[1]
    rows = np.arange(nblocks)[:, None, None] * m + np.arange(m)[None, :, None]  # (B, m, 1)
    out = []
    for offset in (-1, 0, 1):
        cols = (np.arange(nblocks)[:, None, None] + offset) * m + np.arange(m)[None, None, :]
        if periodic:  # the distance j - i as the shortest way around
            distance = (cols - rows + n // 2) % n - n // 2
            cols = cols % n
            band_row = upper_bandwidth - distance
        else:
            band_row = upper_bandwidth + rows - cols
        inside = ((band_row >= 0) & (band_row <= lower_bandwidth + upper_bandwidth)
                  & (cols >= 0) & (cols < n) & (rows < n))
        values = ab[np.clip(band_row, 0, ab.shape[0] - 1), np.clip(cols, 0, n - 1)]
        block = jnp.where(inside, values, 0)
        if offset == 0:  # identity on the padding rows
            block = jnp.where((rows >= n) & (rows == cols), 1, block)
        out.append(block.astype(ab.dtype))
    return out


def banded_solve(bands, rhs, *, lower_bandwidth: int, upper_bandwidth: int,
                 periodic: bool = False):
    """Solve a banded system stored as for `scipy.linalg.solve_banded`.

    `bands[u + i - j, j] = A[i, j]` with `u = upper_bandwidth`, shape
    `(lower_bandwidth + upper_bandwidth + 1, n)`; entries of `bands` outside
    the matrix are unused. The rows are grouped into blocks of
    `m = max(lower_bandwidth, upper_bandwidth, 1)`, which makes the matrix
    block tridiagonal, and `block_tridiagonal_solve` solves it (one
    elimination routine for both; the last block is padded with identity
    rows).

    Args:
        bands: `(l + u + 1, n)`, real or complex.
        rhs: `(n,)` or `(n, *K)`.
        lower_bandwidth, upper_bandwidth: `l` and `u`, Python ints >= 0.
        periodic: the matrix wraps around: entry `A[i, (i + d) mod n]` for
            `-l <= d <= u` is `bands[u - d, (i + d) mod n]` (the entries SciPy's
            storage leaves unused hold the corners). Solved by
            `cyclic_block_tridiagonal_solve`; needs `n` a multiple of
            `max(l, u, 1)` with at least 3 blocks.

    Returns:
        `x` with `rhs`'s shape. Differentiable with respect to `bands` and
        `rhs`; batch with `jax.vmap`. Pivoting happens within blocks only, so
        it is meant for diagonally dominant or SPD matrices (scipy's LAPACK
        `gbsv` pivots across rows and also solves the others).

    Raises:
        ValueError: `bands` whose first dimension is not `l + u + 1`, or
            `rhs` whose leading length is not `n`. TypeError: non-integer
            bandwidths or non-floating inputs.
    """
    lower_bandwidth = checks.check_int("lower_bandwidth", lower_bandwidth, 0)
    upper_bandwidth = checks.check_int("upper_bandwidth", upper_bandwidth, 0)
    checks.check_vector("bands", bands)
    checks.check_vector("rhs", rhs)
    width = lower_bandwidth + upper_bandwidth + 1
    if jnp.ndim(bands) != 2 or jnp.shape(bands)[0] != width:
        raise ValueError(f"`bands` must have shape (lower_bandwidth + upper_bandwidth + 1, n) "
                         f"= ({width}, n) in scipy.linalg.solve_banded's storage; got "
                         f"{tuple(jnp.shape(bands))}.")
    n = jnp.shape(bands)[1]
    if jnp.ndim(rhs) < 1 or jnp.shape(rhs)[0] != n:
        raise ValueError(f"`rhs` must have shape (n, ...) with n = {n} (the columns of "
                         f"`bands`); got {tuple(jnp.shape(rhs))}.")
    dtype = jnp.result_type(bands, rhs)
    bands, rhs = jnp.asarray(bands, dtype), jnp.asarray(rhs, dtype)
    m = max(lower_bandwidth, upper_bandwidth, 1)
    nblocks = -(-n // m)
    if periodic and (n % m or nblocks < 3):
        raise ValueError(f"A periodic banded solve groups rows into blocks of max(l, u, 1) = "
                         f"{m}: it needs n a multiple of {m} with at least 3 blocks; got "
                         f"n = {n}.")
    lower, diag, upper = _band_blocks(bands, lower_bandwidth, upper_bandwidth, m, nblocks,
                                      periodic)
    if periodic:
        return cyclic_block_tridiagonal_solve(lower, diag, upper, rhs.reshape(
            (nblocks, m) + rhs.shape[1:])).reshape(rhs.shape)
    extra = rhs.shape[1:]
    padded = jnp.zeros((nblocks * m,) + extra, dtype).at[:n].set(rhs)
    x = block_tridiagonal_solve(lower, diag, upper, padded.reshape((nblocks, m) + extra))
    return x.reshape((nblocks * m,) + extra)[:n]


def cyclic_block_tridiagonal_solve(lower, diag, upper, rhs):
    """Solve a periodic block-tridiagonal system: `lower[0]` couples block row
    0 to `x[n-1]` and `upper[-1]` couples block row `n-1` to `x[0]`.

    Sherman–Morrison–Woodbury on one block LU: with `A'` the matrix without
    the two corner blocks, `A = A' + U V^T` where `U = [e_0 lower[0],
    e_{n-1} upper[-1]]` and `V = [e_{n-1}, e_0]` (block unit columns, rank
    `2m`). One factorization of `A'` solves `A' y = rhs` and `A' Z = U`
    together (the `2m` columns ride along as right-hand sides); then
    `x = y - Z (I + V^T Z)^{-1} V^T y`, a `2m x 2m` dense solve per batch.
    Needs `A'` nonsingular, as it is for block diagonally dominant `A`.

    Args:
        lower, diag, upper: blocks `(n, m, m)`, `n >= 3`; `lower[0]` and
            `upper[-1]` are the corner blocks.
        rhs: `(n, m)` or `(n, m, *K)`.

    Returns:
        `x` with `rhs`'s shape. Differentiable with respect to all four
        inputs; batch with `jax.vmap`.

    Raises:
        ValueError: as `block_tridiagonal_solve`, or `n < 3`.
    """
    check_blocks(lower, diag, upper)
    n, m = diag.shape[:2]
    _check_rhs(rhs, n, m)
    if n < 3:
        raise ValueError(f"`cyclic_block_tridiagonal_solve` needs n >= 3 block rows; got {n}.")
    dtype = jnp.result_type(lower, diag, upper, rhs)
    lower, diag, upper, rhs = (jnp.asarray(a, dtype) for a in (lower, diag, upper, rhs))
    shape = rhs.shape
    b = _as_matrix_rhs(rhs)
    k = b.shape[-1]
    corners = jnp.zeros((n, m, 2 * m), dtype).at[0, :, :m].set(lower[0]).at[-1, :, m:].set(
        upper[-1])
    both = block_tridiagonal_solve(lower, diag, upper, jnp.concatenate([b, corners], axis=-1))
    y, Z = both[..., :k], both[..., k:]
    Vy = jnp.concatenate([y[-1], y[0]])  # (2m, k)
    VZ = jnp.concatenate([Z[-1], Z[0]])  # (2m, 2m)
    correction = solve(jnp.eye(2 * m, dtype=dtype) + VZ, Vy)
    return (y - mm(Z, correction)).reshape(shape)
