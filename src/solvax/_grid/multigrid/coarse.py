"""The coarsest level's treatments, each one callable type (`CoarseSolve`)
registered in `COARSE`: a dense pseudo-inverse, a block LU along grid lines,
a Chebyshev polynomial; and the gathers a direct solve needs on a sharded grid."""

from __future__ import annotations

import math
from typing import ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ..._core import checks, dense
from ..stencil import StencilOperator, shift_all
from .levels import Level, jitted
from .smoothers import chebyshev, spectrum_bounds
from .transfer import dirichlet_form


class CoarseSolve(Protocol):
    """A treatment of the coarsest level: `z ~ A^{-1} r` on `level` (the
    coarsest; `r` and `z` on its grid, or this device's block of it inside
    `shard_map`). A pytree, built at set-up by `build(op, degree)` from the
    coarsest operator (`degree`: `multigrid`'s `coarse_degree`); `limit`:
    the largest coarsest level it treats (points); `name`: its
    `multigrid(coarse=...)` name."""

    name: ClassVar[str]
    limit: ClassVar[int]

    @classmethod
    def build(cls, op: StencilOperator, degree: int) -> CoarseSolve: ...

    def __call__(self, level: Level, r): ...


#: The coarsest-level treatments by name (`multigrid(coarse=...)`):
#: `register_coarse` adds one.
COARSE: dict[str, type[CoarseSolve]] = {}


def register_coarse(cls: type[CoarseSolve]) -> type[CoarseSolve]:
    """A class decorator: `cls` becomes the treatment `cls.name`."""
    COARSE[cls.name] = cls
    return cls


def global_size(op: StencilOperator) -> int:
    return math.prod(n * (1 if name is None else jax.lax.psum(1, name))
                     for n, name in zip(op.shape, op.axis_names))


def gather(x, axis_names: tuple):
    """The whole grid from the blocks of a `shard_map` (every block gets it)."""
    for axis, name in enumerate(axis_names):
        if name is not None:
            x = jax.lax.all_gather(x, name, axis=axis, tiled=True)
    return x


def own_block(x, shape: tuple, axis_names: tuple):
    """This block of the whole grid `x` (the inverse of `gather`)."""
    for axis, name in enumerate(axis_names):
        if name is not None:
            start = jax.lax.axis_index(name) * shape[axis]
            x = jax.lax.dynamic_slice_in_dim(x, start, shape[axis], axis=axis)
    return x


def gathered_operator(op: StencilOperator) -> StencilOperator:
    """The coarsest operator on the whole grid (inside `shard_map`: gathered)."""
    if all(name is None for name in op.axis_names):
        return op
    entries = {o: gather(jnp.broadcast_to(c, op.shape), op.axis_names)
               for o, c in op.entries.items()}
    shape = next(iter(entries.values())).shape
    return StencilOperator(entries, shape, op.boundary)


def dense_inverse(op: StencilOperator):
    """The pseudo-inverse of the coarsest operator as a dense matrix."""
    size = math.prod(op.shape)
    dtype = jnp.result_type(*op.stored.values())
    eye = jnp.eye(size, dtype=dtype).reshape((size,) + op.shape)
    columns = jax.vmap(op)(eye).reshape(size, size)   # row k: A e_k
    return dense.pinv(columns.T)


@register_coarse
@jax.tree_util.register_pytree_node_class
class DenseInverse:
    """The coarsest level solved with a dense pseudo-inverse computed at
    set-up (`coarse="direct"`: up to 4096 points, `size^2` numbers). A
    cycle gathers the coarsest grid (inside `shard_map`), replicates it
    (`replicated`: under `jit` it is gathered once; a product with a
    sharded vector would be partial sums and an all-reduce on a two-axis
    mesh), multiplies, and each device keeps its block."""

    name, limit = "direct", 4096

    def __init__(self, inverse):
        self.inverse = inverse

    def tree_flatten(self):
        return (self.inverse,), None

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(*leaves)

    @classmethod
    def build(cls, op: StencilOperator, degree: int) -> DenseInverse:
        return cls(jitted(dense_inverse)(gathered_operator(op)))

    def __call__(self, level: Level, r):
        names = level.op.axis_names
        grid = gather(r, names)      # inside shard_map: the whole coarsest grid
        inverse = self.inverse.astype(r.dtype)
        whole = replicated(grid.reshape(inverse.shape[0], 1))
        z = dense.mm(inverse, whole)[:, 0].reshape(grid.shape)
        return own_block(z, r.shape, names)


@register_coarse
@jax.tree_util.register_pytree_node_class
class LineSolve:
    """A direct solve of the coarsest level by block LU along one grid axis
    (`coarse="lines"`; `axis`, not periodic): row block `j` is the
    hyperplane `j` of the grid and couples to the planes `j - 1` and `j + 1`
    only (a 3^d-point stencil is block tridiagonal), so the factorization
    costs `n m^3` and a solve `n m^2` for `n` planes of `m` points: a
    coarsest level of 128^2 points is factored in about 10^9 flops and
    solved in 10^7, where a dense inverse would hold 2.7 * 10^8 numbers.
    Block elimination without pivoting between blocks (stable for SPD and
    block diagonally dominant levels; a singular level, e.g. pure Neumann,
    has no exact factorization: `multigrid`'s `coarse`), its pivot blocks
    inverted at set-up (`line_factors`), so that a solve is one batched
    product and a sweep each way of one block product per plane (a
    triangular solve per plane took 1.8x the time: 64^2 points, 0.64
    against 0.35 ms). Gathered and replicated like `DenseInverse`, and its
    result replicated too (XLA's partitioner otherwise split the scan over
    the planes to match the sharded result, which JAX 0.4.38 failed to
    compile)."""

    name, limit = "lines", 65536

    def __init__(self, factors, axis: int):
        self.factors, self.axis = factors, axis

    def tree_flatten(self):
        return (self.factors,), self.axis

    @classmethod
    def tree_unflatten(cls, axis, leaves):
        return cls(leaves[0], axis)

    @classmethod
    def build(cls, op: StencilOperator, degree: int) -> LineSolve:
        return jitted(line_factors)(gathered_operator(op))

    def __call__(self, level: Level, r):
        names = level.op.axis_names
        grid = gather(r, names)
        return own_block(replicated(self.solve(replicated(grid))), r.shape, names)

    def solve(self, grid):
        """The whole coarsest grid's solve."""
        planes = jnp.moveaxis(grid, self.axis, 0)
        inverse, lower, upper = (a.astype(grid.dtype) for a in self.factors)
        r = planes.reshape(planes.shape[0], math.prod(planes.shape[1:]))
        # S_j y_j = r_j - L_j y_{j-1}, then x_j = y_j - S_j^{-1} U_j x_{j+1}
        g = dense.mm(inverse, r[:, :, None])[:, :, 0]

        def forward(y, row):
            h, gj = row
            y = gj - dense.mm(h, y)
            return y, y

        def backward(x, row):
            c, yj = row
            x = yj - dense.mm(c, x)
            return x, x

        _, y = jax.lax.scan(forward, jnp.zeros_like(r[0]), (lower, g))
        _, z = jax.lax.scan(backward, jnp.zeros_like(r[0]), (upper, y), reverse=True)
        return jnp.moveaxis(z.reshape(planes.shape), 0, self.axis)


@register_coarse
@jax.tree_util.register_pytree_node_class
class ChebyshevLevel:
    """The coarsest level smoothed, not solved (`coarse="chebyshev"`): a
    fixed Chebyshev polynomial of degree `degree` in `D^-1 A` over the
    level's `bounds = (lambda_min, lambda_max)` (`spectrum_bounds`, 20
    Lanczos steps at set-up); SPD for an SPD level, halos only, no gather
    of a grid still split across devices."""

    name, limit = "chebyshev", 4096

    def __init__(self, bounds, degree: int):
        self.bounds, self.degree = bounds, degree

    def tree_flatten(self):
        return (self.bounds,), self.degree

    @classmethod
    def tree_unflatten(cls, degree, leaves):
        return cls(leaves[0], degree)

    @classmethod
    def build(cls, op: StencilOperator, degree: int) -> ChebyshevLevel:
        return cls(jitted(spectrum_bounds)(op), degree)

    def __call__(self, level: Level, r):
        lmin, lmax = (jnp.asarray(v).astype(jnp.abs(r).dtype) for v in self.bounds)
        return chebyshev(level, None, r, lmin, lmax, self.degree)


def _line_axis(boundary: tuple, shape: tuple) -> int | None:
    """The axis `coarse="lines"` factors along: the longest one that is not
    periodic (the fewest points per plane: the least memory and work), None
    if every axis is periodic."""
    able = [a for a, b in enumerate(boundary) if b != "periodic"]
    return max(able, key=lambda a: shape[a]) if able else None


def line_factors(op: StencilOperator) -> LineSolve:
    """`LineSolve` for the coarsest operator (the whole grid): its stencil in
    Dirichlet form (Neumann edges folded in) written as the blocks of the
    planes along its longest non-periodic axis, factored once. The diagonal
    blocks are built dense (they are inverted); the couplings to the
    neighbouring planes stay as their in-plane stencils (`_Couplings`)."""
    form = dirichlet_form(op)
    form = StencilOperator({o: replicated(jnp.broadcast_to(c, op.shape))
                            for o, c in form.stored.items()},
                           op.shape, form.boundary, form.axis_names, form.symmetric)
    axis = _line_axis(form.boundary, op.shape)
    others = tuple(a for a in range(op.ndim) if a != axis)
    plane = tuple(op.shape[a] for a in others)
    boundary = tuple(form.boundary[a] for a in others)
    m = math.prod(plane)
    dtype = jnp.result_type(*form.stored.values())
    diag = jnp.zeros((op.shape[axis], m, m), dtype)
    couplings = {-1: {}, 1: {}}
    for o, c in form.entries.items():
        rows = jnp.moveaxis(jnp.broadcast_to(c, op.shape), axis, 0).reshape(op.shape[axis], m)
        in_plane = tuple(o[a] for a in others)
        if o[axis] == 0:
            diag = diag + rows[:, :, None] * jnp.asarray(_in_plane_shift(plane, in_plane,
                                                                         boundary), dtype)
        else:
            side = couplings[o[axis]]
            side[in_plane] = side.get(in_plane, 0) + rows
    lower = _Couplings({o: c.at[0].set(0) for o, c in couplings[-1].items()}, plane, boundary)
    upper = _Couplings(couplings[1], plane, boundary)
    return LineSolve(_inverted_elimination(lower, diag, upper), axis)


class _Couplings:
    """The blocks `L_j = sum_o diag(c_o[j]) S_o` coupling each plane to the
    one before (or after): per in-plane offset `o` the coefficients `c_o`
    (planes, points) and `S_o` the in-plane shift (`(S_o x)[q] = x[q + o]`,
    zero past a Dirichlet edge, wrapped on a periodic axis). A product with
    a dense block costs one pass per offset (`m^2` each) instead of `m^3`
    (a 16^3 level factored in 83 ms instead of 101; the pivot blocks'
    inverses are the 73 ms left)."""

    def __init__(self, coeffs: dict, plane: tuple, boundary: tuple):
        self.coeffs, self.plane, self.boundary = coeffs, plane, boundary

    def left(self, c: dict, x):
        """`L_j x` for a dense `x` (m, m), `c` plane `j`'s coefficients."""
        return sum((co[:, None] * self._moved(x, o, rows=True) for o, co in c.items()),
                   jnp.zeros_like(x))

    def right(self, x, c: dict):
        """`x L_j` for a dense `x` (m, m): column `q` of `x diag(c_o) S_o`
        is column `q - o` of `x diag(c_o)`."""
        return sum((self._moved(x * co[None, :], tuple(-v for v in o), rows=False)
                    for o, co in c.items()), jnp.zeros_like(x))

    def _moved(self, x, offset: tuple, rows: bool):
        """`x` (m, m) with its rows (or columns) read at the in-plane point
        `q + offset`: `S_o x` (or, with `-o`, `x S_o`)."""
        if rows:
            shape, offset, boundary = (self.plane + x.shape[1:], offset + (0,),
                                       self.boundary + ("dirichlet",))
        else:
            shape, offset, boundary = (x.shape[:1] + self.plane, (0,) + offset,
                                       ("dirichlet",) + self.boundary)
        grid = x.reshape(shape)
        return shift_all(grid, [offset], boundary, (None,) * grid.ndim)[0].reshape(x.shape)


def _in_plane_shift(shape: tuple, offset: tuple, boundary: tuple) -> np.ndarray:
    """The 0/1 matrix `S` with `(S x)[q] = x[q + offset]` on a grid of `shape`
    (flattened), zero past a Dirichlet edge, wrapped on a periodic axis."""
    index = np.indices(shape).reshape(len(shape), math.prod(shape))
    target = index + np.asarray(offset, dtype=int)[:, None]
    inside = np.ones(index.shape[1], bool)
    for a, (n, b) in enumerate(zip(shape, boundary)):
        if b == "periodic":
            target[a] %= n
        else:
            inside &= (target[a] >= 0) & (target[a] < n)
    size = index.shape[1]
    out = np.zeros((size, size))
    rows = np.arange(size)[inside]
    cols = np.ravel_multi_index(tuple(target[:, inside]), shape) if shape else rows
    out[rows, cols] = 1.0
    return out


def _inverted_elimination(lower: _Couplings, diag, upper: _Couplings) -> tuple:
    """`(S^-1, S^-1 L, S^-1 U)` per plane: block elimination's pivot blocks
    `S_j = D_j - L_j S_{j-1}^-1 U_{j-1}` inverted (LU with partial pivoting
    within the block), and the couplings to the planes before and after
    scaled by them (`LineSolve.solve`), as dense blocks."""
    def step(c_prev, row):
        low, d, up = row
        inverse = dense.inv(d - lower.left(low, c_prev))
        c = upper.right(inverse, up)
        return c, (inverse, lower.right(inverse, low), c)

    _, factors = jax.lax.scan(step, jnp.zeros_like(diag[0]),
                              (lower.coeffs, diag, upper.coeffs))
    return factors


def replicated(x):
    """`x` held whole by every device of a sharded grid under `jit`: an
    identity triangular solve along its leading axis, whose operands XLA's
    partitioner replicates (the coarsest grid in a cycle; the coefficients
    the line factors are computed from: factors computed from a grid still
    split across devices came out split too, and every cycle gathered them
    again, 256 KB per cycle for a 32^2 level on 8 devices). Where the dtype
    is emulated (float64 on a TPU, which lowers no float64 triangular solve)
    a product with the identity at full precision, exact too, whose sharded
    contraction the partitioner also returns replicated."""
    rows = x.reshape(x.shape[0], math.prod(x.shape[1:]))
    eye = jnp.eye(rows.shape[0], dtype=x.dtype)
    if dense.emulated(x.dtype):
        return dense.mm(eye, rows).reshape(x.shape)
    solved = jax.lax.linalg.triangular_solve(eye, rows, left_side=True, lower=True)
    return solved.reshape(x.shape)


def checked_coarse_size(coarse: str, coarse_size, operator: StencilOperator) -> int:
    """`coarse_size` checked against what `coarse` can treat."""
    if coarse == "lines" and _line_axis(operator.boundary, operator.shape) is None:
        raise ValueError("`coarse=\"lines\"` factors the coarsest level along an axis that is "
                         "not periodic, and every axis of this operator is periodic: use "
                         "`coarse=\"direct\"` (its pseudo-inverse handles the constant "
                         "null space).")
    limit = COARSE[coarse].limit
    if isinstance(coarse_size, int) and not isinstance(coarse_size, bool) and coarse_size > limit:
        hint = ("" if coarse == "lines" else " For a larger coarsest level pass "
                f"`coarse=\"lines\"` (a block LU along grid lines, up to "
                f"{LineSolve.limit} points).")
        raise ValueError(f"`coarse_size` must be at most {limit} with `coarse=\"{coarse}\"`; "
                         f"got {coarse_size}.{hint}")
    return checks.check_int("coarse_size", coarse_size, 1, limit)
