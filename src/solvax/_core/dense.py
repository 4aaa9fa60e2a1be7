"""Small dense linear algebra: every product at a stated precision, and every
factorization in a form the target can lower.

Two accelerator facts decide what is here (`DESIGN.md`, "Accelerators"):

- A floating `dot_general` without `precision=` runs as one bfloat16 pass
  on a TPU (TF32 on recent NVIDIA GPUs): about 3 digits. Every small dense
  product of a solver (Hessenberg, Gram, Ritz, coarse inverse, basis
  combination) goes through `mm` (or passes `PRECISION` itself), as
  `jax.scipy.sparse.linalg` does. `tests/test_accelerator.py` scans every
  solver's jaxpr for a floating `dot_general` without it.
- A TPU emulates float64 in 32-bit pieces: elementwise arithmetic,
  reductions and products work, but its LU (`solve`, `inv`, `slogdet`)
  does not lower for float64 and its eigensolver compiles for minutes. So
  where the target emulates the dtype (`emulated`: float64 on a TPU, the one
  rule), the factorizations below run as short loops of elementwise
  arithmetic and products (`_portable_*`), which lower wherever float64
  arithmetic does; elsewhere they are the library's (LAPACK, cuSOLVER).
  Both compute the same factorization up to rounding; the tests run the
  portable forms on this CPU against NumPy (`portable()`).
- A TPU's compiler aborts on a float32 SVD once x64 is enabled (and
  compiles the emulated float64 one for about 40 s): `pinv` computes the
  float32 pseudo-inverse from products there (`svd_lowers`,
  `_schulz_pinv`), which float32 multigrid inside float64 refinement needs.

Every function takes the small matrices solvers build (tens to hundreds of
rows); the loops are sequential in the matrix size.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.linalg import solve_triangular as _library_triangular

from . import target

#: The precision every small dense product states.
PRECISION = lax.Precision.HIGHEST

_FORCED = [False]


def mm(a, b):
    """`a @ b` at `PRECISION`."""
    return jnp.matmul(a, b, precision=PRECISION)


@contextlib.contextmanager
def portable():
    """Within it, the factorizations below take their portable forms whatever
    the backend (at trace time): how the tests check on a CPU what a TPU
    runs in float64. JAX's trace caches are cleared on entry and exit: a
    function jitted outside would otherwise keep its other form."""
    _FORCED[0] = True
    jax.clear_caches()
    try:
        yield
    finally:
        _FORCED[0] = False
        jax.clear_caches()


def emulated(dtype) -> bool:
    """Whether the target lowers only elementwise arithmetic and products for
    `dtype`: float64 on a TPU (`jax.default_backend()`, where `jit` places a
    computation with no committed input), or anywhere inside `portable()`."""
    wide = jnp.dtype(dtype) in (jnp.dtype(jnp.float64), jnp.dtype(jnp.complex128))
    return wide and (_FORCED[0] or target.platform() == "tpu")


# ----------------------------------------------------------- the public forms
def lu_factor(a):
    """`(lu, perm)`: `a[perm] = L U` with partial pivoting, `L` unit lower
    (below the diagonal of `lu`) and `U` upper. Batched over leading axes."""
    if emulated(a.dtype):
        return _batched(_portable_lu, a)
    lu, _, perm = lax.linalg.lu(a)
    return lu, perm


def lu_solve(factors, b, trans: bool = False):
    """`a^{-1} b` (or `a^{-T} b`) from `lu_factor(a)`, `b` a vector or a matrix
    of columns; batched like the factors."""
    lu, perm = factors
    if lu.ndim > 2:
        return jax.vmap(lambda f, p, r: lu_solve((f, p), r, trans))(lu, perm, b)
    if not trans:
        y = solve_triangular(lu, b[perm], lower=True, unit_diagonal=True)
        return solve_triangular(lu, y, lower=False)
    z = solve_triangular(lu.T, b, lower=True)
    w = solve_triangular(lu.T, z, lower=False, unit_diagonal=True)
    return jnp.zeros_like(w).at[perm].set(w)


def solve(a, b):
    """`a^{-1} b` by LU with partial pivoting (batched over leading axes of `a`
    and `b` alike)."""
    return lu_solve(lu_factor(a), b)


def inv(a):
    """`a^{-1}` by LU with partial pivoting (batched)."""
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return solve(a, eye)


def solve_triangular(a, b, *, lower: bool, unit_diagonal: bool = False):
    """`a^{-1} b` for triangular `a` (the other triangle is not read)."""
    if emulated(jnp.result_type(a, b)):
        return _portable_triangular(a, b, lower, unit_diagonal)
    return _library_triangular(a, b, lower=lower, unit_diagonal=unit_diagonal)


def cholesky(a):
    """Lower `L` with `a = L L^H` (NaN where `a` is not positive definite)."""
    if emulated(a.dtype):
        return _portable_cholesky(a)
    return jnp.linalg.cholesky(a)


def qr(a, mode: str = "reduced"):
    """`(Q, R)` (`mode="reduced"`) or `R` alone (`mode="r"`), as `jnp.linalg.qr`."""
    if emulated(a.dtype):
        q, r = _portable_qr(a)
        return r if mode == "r" else (q, r)
    return jnp.linalg.qr(a, mode=mode)


def eigh(a):
    """`(eigenvalues ascending, eigenvectors)` of a Hermitian `a`."""
    if emulated(a.dtype):
        return _portable_eigh(a)
    return jnp.linalg.eigh(a)


def eigvalsh(a):
    """The eigenvalues of a Hermitian `a`, ascending."""
    return eigh(a)[0] if emulated(a.dtype) else jnp.linalg.eigvalsh(a)


#: `pinv`'s cutoff in units of `eps` times the largest singular value,
#: independent of the size: a singular multigrid level's null space sits at
#: about `eps` (0.03-0.2 `eps` measured, float32 Poisson with Neumann or
#: periodic edges, 64-4096 points). `jnp.linalg.pinv`'s `10 n eps` grew
#: with the coarsest level and cut its smoothest genuine modes in float32,
#: the ones its coarse correction is for: float32 MG-CG on 256^2 with
#: `coarse_size=4096` took 15 iterations for Poisson (4 with this cutoff)
#: and 169 for a log-normal field (48), and random blocks 300 (11);
#: float64 was unchanged (`docs/multigrid.md`).
CUTOFF = 10


def svd_lowers(dtype) -> bool:
    """Whether the target compiles an SVD in `dtype`. Not a float32 (or
    complex64) one on a TPU with x64 enabled: it aborts the compiler there
    (`Check failed: buffer != nullptr`, JAX 0.10.2, measured on a v5e chip
    with a 64 x 64 matrix, alone or inside a multigrid set-up), where the
    float64 SVD of the same matrix compiles (for about 40 s) and runs.
    Inside `portable()` the CPU takes the TPU's side of the rule."""
    narrow = jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.complex64))
    tpu = _FORCED[0] or target.platform() == "tpu"
    return not (narrow and tpu and jax.config.jax_enable_x64)


def pinv(a):
    """The pseudo-inverse of a square `a`, from its SVD: singular values below
    `CUTOFF * eps` times the largest count as zero.

    Where the target cannot compile the SVD in `a`'s dtype (`svd_lowers`:
    float32 on a TPU with x64 on) it comes from products alone
    (`_schulz_pinv`). Where the dtype is emulated (float64 on a TPU, fewer
    digits than IEEE float64) two Newton–Schulz steps `X <- X (2 I - a X)`
    (each squares the error) refine the SVD's. Written out rather than
    `jnp.linalg.pinv`, whose custom JVP hides the SVD from this rule."""
    if not svd_lowers(a.dtype):
        return _schulz_pinv(a)
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    cutoff = CUTOFF * jnp.finfo(s.dtype).eps * s[..., :1]
    inverse_s = jnp.where(s > cutoff, 1 / jnp.where(s > cutoff, s, 1), 0).astype(a.dtype)
    x = mm(jnp.conj(jnp.swapaxes(vh, -1, -2)) * inverse_s[..., None, :],
           jnp.conj(jnp.swapaxes(u, -1, -2)))
    if emulated(a.dtype):
        eye = jnp.eye(a.shape[0], dtype=a.dtype)
        for _ in range(2):
            x = mm(x, 2 * eye - mm(a, x))
    return x


def _schulz_pinv(a):
    """The pseudo-inverse of a square `a` from products alone: Newton–Schulz
    steps `X <- 2 X - X a X` from `X = a^H / (|a|_1 |a|_inf)`, then two
    steps `X <- X a X`.

    Along each singular direction the step maps `x = sigma X` to
    `x (2 - x)`: from `x_0 >= (sigma / sigma_max)^2 / n` it reaches 1
    (converged, a fixed point) in about `log2(1 / x_0) + 5` steps. The fixed
    count covers every direction down to `10 n eps` times the largest
    (`jnp.linalg.pinv`'s cutoff; `10 sqrt(n) eps` where `|a|_1 |a|_inf` is
    near `sigma_max^2`, as for a stencil). Directions below it (a singular
    matrix's null space, which rounding leaves at about `eps` times the
    largest) are still far from 1 there; the final steps square `x`, so they
    vanish (`x^4`) while converged ones stay. Not run longer, to the SVD
    form's `CUTOFF eps`: each step doubles what rounding puts in a null
    space, and a count that long converged it (Neumann and periodic Poisson
    on 16^2: relative errors 0.79 and 32 against 1e-5). Used where the
    target compiles no SVD in the dtype (`svd_lowers`): the emulated float64
    SVD it would take instead compiled for about 40 s on a TPU, these
    products in a loop in under a second."""
    n = a.shape[-1]
    eps = jnp.finfo(a.dtype).eps
    cutoff = 10 * n * float(eps)   # relative to the largest singular value
    steps = int(np.ceil(np.log2(n / cutoff ** 2))) + 6
    magnitude = jnp.abs(a)
    norm = jnp.max(jnp.sum(magnitude, axis=-2), axis=-1) * jnp.max(jnp.sum(magnitude, axis=-1),
                                                                   axis=-1)
    norm = jnp.where(norm > 0, norm, 1).astype(a.dtype)[..., None, None]
    x = jnp.conj(jnp.swapaxes(a, -1, -2)) / norm

    def step(_, x):
        return 2 * x - mm(x, mm(a, x))

    x = lax.fori_loop(0, steps, step, x)
    for _ in range(2):
        x = mm(x, mm(a, x))
    return x


# ---------------------------------------------------------- portable kernels
def _batched(fn, a):
    for _ in range(a.ndim - 2):
        fn = jax.vmap(fn)
    return fn(a)


def _portable_lu(a):
    n = a.shape[-1]
    rows = jnp.arange(n)

    def step(k, carry):
        a, perm = carry
        p = jnp.argmax(jnp.where(rows >= k, jnp.abs(a[:, k]), -1))
        a = a.at[k].set(a[p]).at[p].set(a[k])
        perm = perm.at[k].set(perm[p]).at[p].set(perm[k])
        below = rows > k
        pivot = a[k, k]
        factor = jnp.where(below, a[:, k] / jnp.where(pivot == 0, 1, pivot), 0)
        a = a - factor[:, None] * jnp.where(rows > k, a[k], 0)[None, :]
        a = a.at[:, k].set(jnp.where(below, factor, a[:, k]))
        return a, perm

    return lax.fori_loop(0, n, step, (a, rows))


def _portable_triangular(a, b, lower: bool, unit_diagonal: bool):
    vector = b.ndim == 1
    a, b = jnp.asarray(a), jnp.asarray(b)
    b = b[:, None] if vector else b
    n = a.shape[0]
    dtype = jnp.result_type(a, b)
    cols = jnp.arange(n)

    def step(i, x):
        k = i if lower else n - 1 - i
        known = (cols < k) if lower else (cols > k)
        row = jnp.where(known, a[k], 0).astype(dtype)
        value = b[k] - jnp.sum(row[:, None] * x, axis=0)
        if not unit_diagonal:
            value = value / a[k, k]
        return x.at[k].set(value)

    x = lax.fori_loop(0, n, step, jnp.zeros(b.shape, dtype))
    return x[:, 0] if vector else x


def _portable_cholesky(a):
    n = a.shape[-1]
    rows = jnp.arange(n)

    def step(k, carry):
        a, L = carry
        d = jnp.sqrt(jnp.real(a[k, k]))  # NaN where not positive definite
        col = jnp.where(rows >= k, a[:, k] / d, 0)
        a = a - col[:, None] * jnp.conj(col)[None, :]
        return a, L.at[:, k].set(col)

    return lax.fori_loop(0, n, step, (a, jnp.zeros_like(a)))[1]


def _portable_qr(a):
    """Householder QR: reduced `(Q, R)` of an `(m, n)` matrix."""
    m, n = a.shape
    k_max = min(m, n)
    rows = jnp.arange(m)

    def step(k, carry):
        r, q = carry
        x = jnp.where(rows >= k, r[:, k], 0)
        norm = jnp.sqrt(jnp.sum(jnp.abs(x) ** 2))
        head = r[k, k]
        phase = jnp.where(head == 0, 1, head / jnp.where(head == 0, 1, jnp.abs(head)))
        v = x.at[k].add(phase * norm)  # x + sign(x_k) |x| e_k: no cancellation
        size = jnp.sqrt(jnp.sum(jnp.abs(v) ** 2))
        v = v / jnp.where(size == 0, 1, size)
        r = r - 2 * v[:, None] * jnp.sum(jnp.conj(v)[:, None] * r, axis=0)[None, :]
        q = q - 2 * jnp.sum(q * v[None, :], axis=1)[:, None] * jnp.conj(v)[None, :]
        return r, q

    r, q = lax.fori_loop(0, k_max, step, (a, jnp.eye(m, dtype=a.dtype)))
    r = jnp.triu(r[:k_max])
    return q[:, :k_max], r


#: Cyclic Jacobi sweeps: convergence is quadratic once the off-diagonal part
#: is small; 10 sweeps took random SPD matrices up to 64 x 64 to rounding
#: (measured; the tests check 1, 5 and 33).
_JACOBI_SWEEPS = 10


def _jacobi_tangent(app, aqq, apq):
    """`t = tan(theta)` of the Jacobi rotation that zeroes `apq`:
    `sign(tau) / (|tau| + sqrt(1 + tau^2))`, `tau = (aqq - app) / (2 apq)`,
    from the ratio of the smaller to the larger of the two differences, so
    nothing squares a large number (emulated float64 has float32's exponent
    range: `tau^2` overflowed and a TPU returned NaN eigenvalues)."""
    d, e = aqq - app, 2 * apq
    wide = jnp.abs(d) > jnp.abs(e)
    r = jnp.where(wide, e, d) / jnp.where(wide, d, jnp.where(e == 0, 1, e))
    sign = jnp.where((d >= 0) == (e >= 0), 1, -1).astype(r.dtype)
    root = 1 + jnp.sqrt(1 + r * r)
    t = sign * jnp.where(wide, jnp.abs(r) / root, 1 / (jnp.abs(r) + root - 1))
    return jnp.where(e == 0, 0, t)


def _portable_eigh(a):
    """Cyclic Jacobi for a real symmetric `a` (rotations in every (p, q))."""
    if jnp.iscomplexobj(a):
        raise NotImplementedError("the portable eigensolver is real (a TPU has no complex128)")
    n = a.shape[-1]
    pairs = np.array([(p, q) for p in range(n) for q in range(p + 1, n)], np.int32)
    if len(pairs) == 0:
        return jnp.diagonal(a), jnp.eye(n, dtype=a.dtype)

    def rotate(i, carry):
        a, v = carry
        p, q = pairs_[i, 0], pairs_[i, 1]
        t = _jacobi_tangent(a[p, p], a[q, q], a[p, q])
        c = 1 / jnp.sqrt(1 + t * t)
        s = t * c
        rp, rq = a[p], a[q]
        a = a.at[p].set(c * rp - s * rq).at[q].set(s * rp + c * rq)
        cp, cq = a[:, p], a[:, q]
        a = a.at[:, p].set(c * cp - s * cq).at[:, q].set(s * cp + c * cq)
        vp, vq = v[:, p], v[:, q]
        v = v.at[:, p].set(c * vp - s * vq).at[:, q].set(s * vp + c * vq)
        return a, v

    pairs_ = jnp.asarray(pairs)
    sweep = functools.partial(lax.fori_loop, 0, len(pairs), rotate)
    a, v = lax.fori_loop(0, _JACOBI_SWEEPS, lambda _, c: sweep(c), (a, jnp.eye(n, dtype=a.dtype)))
    values = jnp.diagonal(a)
    order = jnp.argsort(values)
    return values[order], v[:, order]
