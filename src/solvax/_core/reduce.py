"""The reduction layer: every inner product and norm in solvax is computed here.

Per-leaf products are `sum(conj(x) * y)` — never `vdot`, `ravel` or
`reshape(-1)`, which all-gather a leaf sharded on a non-leading axis. A solver
asks for *all independent products of one step at once*, and the layer
evaluates them as one global reduction: one `lax.psum` of the stacked local
sums inside `shard_map`; under `jit`, by the one rule `stacks_products`, the
per-leaf products stacked along a new leading axis before one sum (a mesh
on XLA:CPU, where each array of an all-reduce is a rendezvous) or separate
sums (one device; a GPU or TPU mesh, where XLA's combiner makes them one
tuple all-reduce, one collective there). Separate sums of an emulated dtype
(float64 on a TPU) run in sequence by `sums_in_sequence`; a loop reduces
before its first step by `reduces_before_loop` (one device), and GMRES's
steps read the basis rows in use only by `reads_rows_in_use` (one TPU).

Every kind of inner product derives from `Reduction`, whose only primitives
are the batched reductions `multi_dot`, `project_many` and `gram`; `project`,
`project_with_norm`, `dot` and `norm` are defined once, in the base, from
them. So no kind can silently fall back to another's products.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import checks, dense, target, tree
from .closure import axes_communicated, close
from .dense import PRECISION

PyTree = Any
Pair = tuple[PyTree, PyTree]

#: Whether XLA merges the independent all-reduces of one step into one
#: (variadic) instruction under `jit` (its all-reduce combiner): measured
#: (tests/test_sharding.py pins it) not on jax 0.4.38, 0.5.3 and 0.6.2; yes on
#: 0.7.2, 0.8.3, 0.9.2 and 0.10.2. One instruction, but as many
#: synchronizations as arrays on XLA:CPU: the layer does not rely on it.
MERGES_ALL_REDUCES = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 7)


class Reduction(abc.ABC):
    """An inner product `<x, y>` on pytrees, evaluated in batched reductions.

    Subclasses implement the two primitives; each call of one is one global
    reduction (one synchronization point of a solver step).
    """

    @abc.abstractmethod
    def multi_dot(self, pairs: Sequence[Pair]) -> jax.Array:
        """`[<x_1, y_1>, ..., <x_k, y_k>]` in one reduction."""

    @abc.abstractmethod
    def project_many(self, basis: PyTree, xs: Sequence[PyTree],
                     pairs: Sequence[Pair] = ()) -> tuple[jax.Array, jax.Array]:
        """`([V^H x for x in xs], [<x, y> for x, y in pairs])`, shapes
        `(len(xs), m)` and `(len(pairs),)`, in one reduction; `basis` has
        leaves `(m, *leaf.shape)`."""

    @abc.abstractmethod
    def gram(self, basis: PyTree, other: PyTree) -> jax.Array:
        """`V^H W` of shape `(m, k)` in one reduction, for bases with leaves
        `(m, *leaf.shape)` and `(k, *leaf.shape)`: every product of a block
        method's step at once (s-step CG)."""

    @abc.abstractmethod
    def max_abs(self, x: PyTree) -> jax.Array | None:
        """`max |x_i|` over every entry (one reduction), or None where this kind
        cannot tell (then a solve is not rescaled)."""

    @abc.abstractmethod
    def closed(self, like: PyTree) -> Reduction:
        """This inner product with every traced value it reads a pytree leaf."""

    # -- derived from the primitives, for every kind alike ----------------------
    def project(self, basis: PyTree, x: PyTree) -> jax.Array:
        """`V^H x` (length m) in one reduction."""
        return self.project_many(basis, [x])[0][0]

    def project_with_norm(self, basis: PyTree, x: PyTree) -> tuple[jax.Array, jax.Array]:
        """`(V^H x, <x, x>)` in one reduction."""
        projections, products = self.project_many(basis, [x], [(x, x)])
        return projections[0], products[0]

    def dot(self, x: PyTree, y: PyTree) -> jax.Array:
        return self.multi_dot([(x, y)])[0]

    def norm(self, x: PyTree) -> jax.Array:
        return real_sqrt(self.dot(x, x))

    def reduced_axes(self) -> tuple:
        """The mesh axes this product reduces over (inside `shard_map`)."""
        return ()

    def typed_like_results(self, tree_: PyTree, like: PyTree) -> PyTree:
        """`tree_` (a loop's starting state) made varying over the mesh axes
        this product's results on vectors `like` vary over: inside `shard_map`,
        a solve of independent per-shard systems (no `axis_name`) reduces
        locally, and its loop carries must start with the type they end with."""
        axes = set(_varying_axes(like)) - set(self.reduced_axes())
        if not axes:
            return tree_

        def vary(leaf):
            missing = tuple(sorted(axes - set(_varying_axes(leaf))))
            if not missing:
                return leaf
            if hasattr(lax, "pcast"):
                return lax.pcast(leaf, missing, to="varying")
            return lax.pvary(leaf, missing)  # jax 0.6 to 0.8

        return jax.tree_util.tree_map(vary, tree_)

    def power_of_two_scale(self, x: PyTree) -> jax.Array | None:
        """A power of two near `max |x_i|` (1 for x = 0), in x's real dtype:
        dividing by it is exact and brings the entries near 1, so no squared
        norm of a solve under- or overflows whatever the scale of `x`. NaN or
        Inf when `x` holds them; None where `max_abs` is."""
        largest = self.max_abs(x)
        if largest is None:
            return None
        scale = power_of_two_below(jnp.where(largest > 0, largest, 1))
        return jnp.where(jnp.isfinite(largest), scale, largest)  # NaN or Inf propagates


def power_of_two_below(value: jax.Array) -> jax.Array:
    """`2^floor(log2 value)` for positive finite `value`, exactly: what
    `ldexp(1, frexp(value)[1] - 1)` gives, without either. `frexp`/`ldexp`
    bitcast to the integer type of the same width, which a TPU cannot lower
    for 64-bit floats (it emulates float64 in pairs of float32). Here the
    exponent comes from `log2` (possibly one off next to a power of two),
    the power from multiplying one independent factor `2^(2^k)` per bit of
    it (exact: every partial product is a power of two in range), and one
    comparison each way corrects it. A value below the smallest normal
    number gets that number (`finfo.tiny`): a backend that flushes
    subnormals to zero would otherwise return 0. Where float64 is emulated
    its exponent range is float32's, and so is this function's.

    The factors are independent on purpose: a first version divided out
    `2^(2^k)` step by step, each step reading the last one three times, and
    XLA:CPU, which fuses elementwise chains into their consumers without
    sharing, compiled the IDR(s) adjoint for minutes instead of seconds."""
    dtype = value.dtype
    limits = jnp.finfo(jnp.float32 if dense.emulated(dtype) else dtype)
    tiny = jnp.asarray(limits.tiny, dtype)
    value = jnp.maximum(value, tiny)
    exponent = jnp.clip(jnp.floor(jnp.log2(value)), limits.minexp, limits.maxexp - 1)
    exponent = exponent.astype(jnp.int32)
    magnitude = jnp.abs(exponent)
    power = jnp.ones_like(value)
    for k in range((int(limits.maxexp) - 1).bit_length()):  # the bits of |exponent| < maxexp
        factor = jnp.asarray(float(2 ** 2**k), dtype)
        power = power * jnp.where((magnitude >> k) & 1 == 1, factor, 1)
    scale = jnp.where(exponent < 0, 1 / power, power)
    scale = jnp.where(scale > value, scale / 2, scale)
    scale = jnp.where(2 * scale <= value, 2 * scale, scale)
    return jnp.maximum(scale, tiny)


def stacks_products(backend: str | None = None, devices: int | None = None) -> bool:
    """The one rule for the pattern of a step's products under `jit`.

    Stacked: the per-leaf products of a step are stacked along a new leading
    axis and summed once, so a mesh reduces one array per step by
    construction. Separate: one sum (or GEMV) per product, the scalars
    stacked afterwards. Both give one synchronization per reduction call on a
    mesh where it matters; they differ in what a step costs on the device:

    - **one device** (`devices == 1`): separate. There is nothing to
      synchronize, and the stacked form materializes the `(k, *shape)` array
      of products before summing it (XLA:CPU does not fuse the stack into
      the reduction): per step on one CPU device at 256^2, float64,
      separate against stacked: one-sync BiCGStab 0.58 against 1.60 ms,
      GMRES(30) with CGS2 1.26 against 3.58 ms per matvec, GMRES one-sync
      1.45 against 1.77, BiCGStab 0.24 against 0.27.
    - **a GPU or TPU mesh** on JAX >= 0.7: separate. XLA's all-reduce
      combiner merges a step's independent all-reduces into one tuple
      (variadic) all-reduce, which these backends run as one collective.
    - **an XLA:CPU mesh**, or any mesh on JAX < 0.7 (no combiner): stacked.
      XLA:CPU runs a tuple all-reduce as one rendezvous per array, and the
      communication table pins what it executes.

    `backend` and `devices` default to JAX's default backend and its device
    count (the target a `jit` without explicit devices compiles for).
    """
    backend = target.platform() if backend is None else backend
    devices = target.devices() if devices is None else devices
    if devices == 1:
        return False
    return backend == "cpu" or not MERGES_ALL_REDUCES


def sums_in_sequence(devices: int | None = None) -> bool:
    """The rule for a step's separate sums where the dtype is emulated
    (`dense.emulated`: float64 on a TPU): in sequence, each pair of vectors
    read only after the sum before it, on one device (`devices`, default
    JAX's device count) and inside `shard_map` (the local sums; one `psum`
    follows either way). XLA:TPU otherwise fuses a step's emulated
    reductions, with the arithmetic that makes their vectors, into kernels
    whose compile runs for minutes: the refinement at 4096^2 returning its
    whole `Solution` (its `||r||^2` and `||x||^2` share a call) compiled for
    more than 120 s, and in 27 s in sequence (`benchmarks/results/tpu.md`).
    Under `jit` on a mesh they stay independent: a chain would keep XLA's
    combiner from merging their all-reduces into one synchronization."""
    devices = target.devices() if devices is None else devices
    return devices == 1


def reduces_before_loop(devices: int | None = None) -> bool:
    """The rule for a reduction before an iteration's loop: taken on one
    device (`devices`, default JAX's device count), where it synchronizes
    nothing; not on a mesh, where PCG's table pins none. With it, standard
    CG tests `<r, r>` at the close of each step, fused with `r`'s update,
    and applies `M` only to go on (3 vector kernels a step on a TPU, as
    `jax.scipy`'s cg; an MG-CG solve one V-cycle fewer), and the other CG
    recurrences take their threshold from `||b||^2` before the loop
    (`benchmarks/results/tpu.md`). The same arithmetic either way."""
    devices = target.devices() if devices is None else devices
    return devices == 1


def reads_rows_in_use(backend: str | None = None, devices: int | None = None) -> bool:
    """The rule for GMRES's Arnoldi steps: on one TPU (`backend`,
    `devices`: JAX's default backend and its device count unless given)
    each step's projections and combinations read the basis rows in use
    only, rounded up to a quarter of the basis, one conditional branch per
    quarter (`arnoldi.on_rows`), where a step otherwise reads every row.
    GMRES(30) on a TPU v5e, float32, per matvec against jax.scipy's gmres
    at 1024^2 / 2048^2 / 4096^2: one-sync 0.68 / 1.07 / 1.05x (every row:
    1.01 / 1.08 / 1.12x), CGS2 1.15 / 1.19 / 1.26x (every row: 1.87 / 1.90
    / 1.82x) (`benchmarks/results/tpu.md`). There a combination sums one
    coefficient vector at a time: XLA:TPU copied the sliced block into
    memory before a sum of two at once (one-sync 1.16x at 2048^2). Not on
    a mesh (each branch would hold the step's all-reduce; the pinned count
    is one per reduction) nor on a CPU (XLA:CPU copies a sliced GEMV or
    GEMM operand before it). The same arithmetic either way."""
    backend = target.platform() if backend is None else backend
    devices = target.devices() if devices is None else devices
    return devices == 1 and backend == "tpu"


@jax.tree_util.register_pytree_node_class
class InnerProduct(Reduction):
    """The inner product `<x, y> = sum_leaves sum(conj(x) * weight * y)`.

    Args:
        axis_name: inside `shard_map`, the mesh axis (or tuple of axes) the
            vectors are split over; the local partial sums are combined with
            one `lax.psum`, so every shard sees the same global values. Leave
            `None` under plain `jit` (GSPMD inserts the all-reduce).
        weight: optional pytree of positive real weights with the structure of
            the vectors (a diagonal SPD metric).
    """

    def __init__(self, *, axis_name: str | tuple[str, ...] | None = None, weight: PyTree = None):
        checks.check_axis_name(axis_name)
        self.axis_name = axis_name
        self.weight = weight

    def __repr__(self) -> str:
        return f"InnerProduct(axis_name={self.axis_name!r}, weighted={self.weight is not None})"

    # A pytree (the weights are its leaves), so solvers take it as an argument.
    def tree_flatten(self):
        return (self.weight,), self.axis_name

    @classmethod
    def tree_unflatten(cls, axis_name, children):
        return cls(axis_name=axis_name, weight=children[0])

    def closed(self, like: PyTree) -> InnerProduct:
        return self

    def reduced_axes(self) -> tuple:
        if self.axis_name is None:
            return ()
        return self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)

    def _global_sum(self, partials: list[jax.Array]) -> jax.Array:
        """Add the per-leaf partial k-vectors (or k x m blocks) and reduce them once
        (in the widest leaf dtype: leaves of several precisions add explicitly)."""
        dtype = tree.result_dtype(partials)
        total = partials[0].astype(dtype)
        for partial in partials[1:]:
            total = total + partial.astype(dtype)
        if self.axis_name is not None:
            total = lax.psum(total, self.axis_name)
        return total

    def _leaves(self, x: PyTree, weighted: bool = False) -> list[jax.Array]:
        if weighted and self.weight is not None:
            x = jax.tree_util.tree_map(lambda w, v: tree.like(w, v) * v, self.weight, x)
        return jax.tree_util.tree_leaves(x)

    def _pair_leaves(self, pairs: Sequence[Pair]) -> list[list[jax.Array]]:
        """Per leaf, the elementwise products `conj(x) * weight * y` of every pair."""
        xs = [self._leaves(x) for x, _ in pairs]
        ys = [self._leaves(y, weighted=True) for _, y in pairs]
        return [[jnp.conj(x[leaf]) * y[leaf] for x, y in zip(xs, ys)]
                for leaf in range(len(xs[0]))]

    def max_abs(self, x: PyTree) -> jax.Array:
        real = jnp.finfo(tree.result_dtype(x)).dtype
        largest = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(leaf)).astype(real)
                                                 for leaf in self._leaves(x)])
        if self.axis_name is not None:
            largest = lax.pmax(largest, self.axis_name)
        return largest

    def multi_dot(self, pairs: Sequence[Pair]) -> jax.Array:
        # Separate sums, or (`stacks_products`) the k products stacked on a new
        # leading axis: one sum over the vector axes, one reduction of a
        # k-vector by construction.
        if self._separate_kernels():
            return self._global_sum([jnp.stack(sums) for sums in self._pair_sums(pairs)])
        return self._global_sum([_sum_vector_axes(jnp.stack(products))
                                 for products in self._pair_leaves(pairs)])

    def gram(self, basis, other):
        """Per leaf one contraction over the vector axes (a GEMM on one device;
        under `jit` the partitioner reduces a sharded contracting axis with one
        all-reduce), the per-leaf blocks added before the one global sum."""
        def block(v, w):
            axes = tuple(range(1, v.ndim))
            return lax.dot_general(jnp.conj(v), w, ((axes, axes), ((), ())), precision=PRECISION)

        partials = [block(v, w) for v, w in
                    zip(self._leaves(basis), self._leaves(other, weighted=True))]
        return self._global_sum(partials)

    def _pair_sums(self, pairs: Sequence[Pair]) -> list[list[jax.Array]]:
        """Per leaf, the sum of each pair's products (separate kernels), in
        sequence where `sums_in_sequence` rules: each pair read only after
        the sum before it (an optimization barrier)."""
        leaves = jax.tree_util.tree_leaves(pairs)
        emulated = any(dense.emulated(leaf.dtype) for leaf in leaves)
        if not (emulated and (self.axis_name is not None or sums_in_sequence())):
            return [[jnp.sum(p) for p in products] for products in self._pair_leaves(pairs)]
        sums: list[list[jax.Array]] = []  # per pair, per leaf
        for pair in pairs:
            if sums:
                sums[-1], pair = lax.optimization_barrier((sums[-1], pair))
            sums.append([jnp.sum(products[0]) for products in self._pair_leaves([pair])])
        return [list(leaf_sums) for leaf_sums in zip(*sums)]

    def _separate_kernels(self) -> bool:
        """Whether the products of one step run as separate kernels: inside
        `shard_map` always (their local partials are stacked before the one
        `psum`), under `jit` as `stacks_products` rules for the target."""
        return self.axis_name is not None or not stacks_products()

    def project_many(self, basis, xs, pairs=()):
        """Per leaf, contractions over the vector axes (`dot_general`: the
        partitioner reduces a sharded contracting axis with one all-reduce, and
        on one device it is a BLAS GEMV), conjugating the vectors rather than
        the basis: `V^H x = conj(V^T conj(x))`. With separate kernels (inside
        `shard_map`, where the local partials are stacked before the psum, and
        where `stacks_products` says not to stack), one GEMV per vector
        (faster than a skinny GEMM on XLA's CPU backend: `docs/krylov.md`,
        "skinny GEMM") and one sum per pair; otherwise one
        contraction with the vectors stacked, or, with pairs, every product
        stacked elementwise before one sum."""
        vs = self._leaves(basis)
        xls = [self._leaves(x, weighted=True) for x in xs]
        separate = self._separate_kernels()
        # per leaf, the pairs' sums (separate kernels) or their products (stacked)
        terms = ((self._pair_sums if separate else self._pair_leaves)(pairs) if pairs
                 else [[] for _ in vs])
        m, count = len(jax.tree_util.tree_leaves(basis)[0]), len(xs)
        partials = []
        for leaf, v in enumerate(vs):
            conj_xs = [jnp.conj(xl[leaf]) for xl in xls]
            pair_rows = [t[None] for t in terms[leaf]]
            if separate:  # the small result vectors
                blocks = [_basis_times(v, cx) for cx in conj_xs] + pair_rows
                partials.append(jnp.concatenate(blocks, axis=0))
            elif not pairs:  # (m, *shape) . (*shape, s) -> (m, s)
                partials.append(_basis_times(v, jnp.stack(conj_xs, axis=-1)).T.reshape(m * count))
            else:  # along the small leading (stacking) axis
                stacked = jnp.concatenate([v * cx[None] for cx in conj_xs] + pair_rows, axis=0)
                partials.append(_sum_vector_axes(stacked))
        total = self._global_sum(partials)
        return jnp.conj(total[: m * count]).reshape(count, m), total[m * count:]


@jax.tree_util.register_pytree_node_class
class _CallableInnerProduct(Reduction):
    """Wraps a user function `(x, y) -> scalar`; each product is its own reduction."""

    def __init__(self, fn: Callable[[PyTree, PyTree], jax.Array], axes: tuple = ()):
        self.fn = fn
        self.axes = axes  # the mesh axes its trace reduces over (`closed`)

    def __repr__(self) -> str:
        return f"InnerProduct({self.fn!r})"

    def tree_flatten(self):
        return (self.fn,), self.axes

    @classmethod
    def tree_unflatten(cls, axes, children):
        return cls(children[0], axes)

    def closed(self, like: PyTree) -> Reduction:
        fn = close(self.fn, like, like)
        return _CallableInnerProduct(
            fn, tuple(sorted(axes_communicated(jax.make_jaxpr(fn)(like, like).jaxpr))))

    def reduced_axes(self) -> tuple:
        return self.axes

    def max_abs(self, x):
        return None  # a user's product says nothing of the entries' range

    def multi_dot(self, pairs):
        return jnp.stack([jnp.asarray(self.fn(x, y)) for x, y in pairs])

    def gram(self, basis, other):
        return jax.vmap(lambda v: jax.vmap(lambda w: jnp.asarray(self.fn(v, w)))(other))(basis)

    def project_many(self, basis, xs, pairs=()):
        projections = jnp.stack([jax.vmap(lambda v, x=x: jnp.asarray(self.fn(v, x)))(basis)
                                 for x in xs])
        products = self.multi_dot(pairs) if pairs else jnp.zeros((0,), projections.dtype)
        return projections, products


def _varying_axes(tree_: PyTree) -> set:
    """The mesh axes any leaf varies over (empty outside `shard_map`, and on
    JAX versions without varying-axis types)."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return set()

    def axes(aval):
        manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.9; before: `vma`
        return manual.varying if manual is not None else getattr(aval, "vma", ())

    return {axis for leaf in jax.tree_util.tree_leaves(tree_) for axis in axes(typeof(leaf))}


def _sum_vector_axes(stacked: jax.Array) -> jax.Array:
    """Sum over every axis but the leading (stacking) one."""
    return jnp.sum(stacked, axis=tuple(range(1, stacked.ndim)))


def _basis_times(v: jax.Array, x: jax.Array) -> jax.Array:
    """`V^T x` for a basis leaf `(m, *shape)` and `x` of shape `shape` (or
    `(*shape, s)`): one contraction over the vector axes, basis first."""
    axes = tuple(range(v.ndim - 1))
    return lax.dot_general(v, x, ((tuple(a + 1 for a in axes), axes), ((), ())),
                           precision=PRECISION)


def real_sqrt(value: jax.Array) -> jax.Array:
    """`sqrt(max(Re(value), 0))`: a norm from a squared norm."""
    return jnp.sqrt(jnp.maximum(jnp.real(value), 0))


def resolve(inner_product=None, axis_name=None) -> Reduction:
    """The inner product a solver uses for its `inner_product=` / `axis_name=` options."""
    if inner_product is None:
        return InnerProduct(axis_name=axis_name)
    if axis_name is not None:
        raise ValueError(
            "Pass either `inner_product` or `axis_name`, not both: "
            "use `InnerProduct(axis_name=..., weight=...)` to combine them."
        )
    if isinstance(inner_product, InnerProduct):
        return inner_product
    if callable(inner_product):
        return _CallableInnerProduct(inner_product)
    raise TypeError(
        "`inner_product` must be None, a `solvax.InnerProduct` or a function "
        f"`(x, y) -> scalar`; got {type(inner_product).__name__}."
    )


__all__ = ["InnerProduct", "Reduction", "resolve", "real_sqrt", "stacks_products"]
