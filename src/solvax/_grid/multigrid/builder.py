"""`multigrid`: the public builder. Checks its options, builds the
hierarchy, the coarsest level's treatment and the storage precision."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from ..._core import checks, target
from ..stencil import StencilOperator
from . import rule
from .coarse import COARSE, DenseInverse, checked_coarse_size
from .cycle import CYCLES, Multigrid
from .hierarchy import build_hierarchy, is_concrete, shards_of
from .levels import Level, Tail
from .smoothers import SMOOTHERS
from .transfer import INTERPOLATIONS


def multigrid(operator: StencilOperator, *, cycle: str = "V", smoother: str = "jacobi",
              steps: int = 2, coarse_size: int | None = None, max_levels: int = 30,
              semicoarsening: float = 0.5, chebyshev_lower: float = 0.25,
              shards: tuple | None = None, dtype=None, coarse: str = "auto",
              coarse_degree: int = 8, interpolation: str = "auto",
              storage_dtype=None) -> Multigrid:
    """A geometric multigrid preconditioner for a structured-grid operator.

    Builds a hierarchy from `operator`'s stencil: each level coarsens the
    grid by two along its strongly coupled axes (all of them for an
    isotropic operator; only the strong ones where it is anisotropic:
    semicoarsening), with the Galerkin coarse operator `R A P`
    (operator-dependent interpolation `P`, `R = P^T`) computed as a
    stencil; the coarsest level (at most `coarse_size` points, or nothing
    left to coarsen) is solved with a dense pseudo-inverse. Applying it runs one cycle from zero.

    With symmetric smoothing (the same `steps` before and after) the cycle
    is symmetric positive definite for an SPD operator, so it preconditions
    `pcg`; it preconditions `gmres`, `bicgstab`, `idrs` and `minres` (SPD
    operators) alike. A cycle computes no inner product: on a sharded grid
    it communicates only halos (collective-permutes) and the coarsest grid.

    Example:
        ```python
        A = sx.diffusion_operator(k, spacing=1 / 256)     # k: (256, 256)
        sol = sx.pcg(A, f, precond=sx.multigrid(A))      # ~10 iterations at any size
        ```

    Args:
        operator: a `StencilOperator` whose offsets are within one point
            per axis (e.g. from `diffusion_operator` or `stencil_operator`).
        cycle: `"V"`, `"W"` or `"F"` (on each level an F-cycle then a
            V-cycle below it: between V and W in work). V and W cycles are
            symmetric (for CG); an F-cycle is not (use it with `gmres`,
            `bicgstab` or `multigrid_solve`).
        smoother: `"jacobi"` (damped, `omega = 8 / (5 lambda_max(D^-1 A))`
            on 2- and 3-D grids, `4 / (3 lambda_max)` on 1-D ones)
            or `"chebyshev"` (a polynomial in `D^-1 A` over
            `[chebyshev_lower * 1.1 lambda_max, 1.1 lambda_max]`), with
            `lambda_max` estimated per level at set-up by power iteration.
        steps: smoothing steps (Chebyshev: degree) before and after the
            coarse correction (>= 1).
        coarse_size: the largest coarsest grid (points): at most 4096 for
            `coarse="direct"` and `"chebyshev"`, 65536 for `"lines"`. None
            (default): the rule's (below), 64 points for a coarse treatment
            given explicitly.
        max_levels: the most levels (>= 1).
        semicoarsening: an axis is coarsened when its coupling is at least
            this fraction of the strongest axis's (in `(0, 1]`; 1e-12 or so
            coarsens every axis). Measured from concrete coefficients; when
            they are traced (set-up under `jit`), every axis is coarsened.
        chebyshev_lower: the lower end of the Chebyshev interval as a
            fraction of its upper end (in `(0, 1)`).
        shards: per grid axis, the number of devices splitting it; no level
            has fewer points than that along the axis (XLA's partitioner
            reshuffles a sharded axis shorter than its mesh axis with
            all-to-alls and all-reduces). Read from the coefficients'
            sharding when they are concrete arrays; pass it when the set-up
            is traced under `jit`, e.g. `shards=(8, 1)` for `P("i", None)`
            on 8 devices. All ones (or a process with one device) says the
            grid is on one device: under `jit` the coarse levels from 1/64
            of the finest grid's points down are then padded to one shape
            and compiled once (a shorter compile; `docs/multigrid.md`).
        coarse: how the coarsest level is treated. `"auto"` (default): read
            from the coefficients by a documented rule (`docs/multigrid.md`,
            "The default, chosen from the coefficients"): where they are
            concrete and jump on features 4 cells wide or more (random
            blocks, inclusions), not shift-dominated there, `"lines"` at a
            grid spacing of 4 cells (`coarse_size = points // 4^d`; random
            blocks of contrast 1e4 at 512^2: 8 CG iterations against 222-660
            with the plain configuration, ahead of Ruge-Stueben's 16-28);
            otherwise `"direct"` with a 64-point coarsest level. A
            `coarse_size` given with `"auto"` picks `"direct"` up to 4096
            points and `"lines"` above. Traced coefficients (the set-up
            under `jit`) get the plain configuration: the choice fixes the
            hierarchy's shapes. `"direct"`: a
            dense pseudo-inverse computed at set-up; on a grid still split
            across devices its residual is gathered once per cycle (one
            all-gather: a global synchronization in every Krylov
            iteration). `"chebyshev"`: smoothed, not solved: a Chebyshev
            polynomial of degree `coarse_degree` in `D^-1 A` over the
            level's `[lambda_min, lambda_max]` (20 Lanczos steps at
            set-up); a cycle then communicates only halos. It pays where a
            global collective costs more than `coarse_degree` neighbour
            exchanges of the tiny coarsest grid (many devices); on a few
            devices the gather is cheaper (`docs/multigrid.md`).
            `"lines"`: solved directly by block LU along the longest
            non-periodic grid axis (each plane of the grid one block: a
            3^d-point stencil is block tridiagonal), which allows a much
            larger coarsest level (`coarse_size` up to 65536 points; a
            128^2 level is factored in about 10^9 flops and solved in 10^7
            per cycle (measured on one CPU: 80 ms and 7.8 ms), gathered
            like `"direct"` on a sharded grid). For
            coefficients that jump on small blocks, stopping the hierarchy
            before its grids get coarser than the blocks is what makes
            multigrid robust (random blocks of contrast 1e4, 512^2, 4^2
            blocks: 8 CG iterations with `coarse="lines",
            coarse_size=16384` and full interpolation with Gauss-Seidel,
            against 98 with the W-cycle down to 8^2; `docs/multigrid.md`).
            For a nonsingular coarsest level: a singular one (a pure
            Neumann operator without a shift) has no exact factorization,
            and the solve either still meets its tolerance (checked on the
            true residual) or stops with a non-converged status; its
            pseudo-inverse (`"direct"`) is the sound choice there.
        coarse_degree: the Chebyshev degree with `coarse="chebyshev"` (>= 1;
            matvecs on the coarsest level per cycle).
        interpolation: `"auto"` (default): `"full"` where the rule above
            chooses lines on a 3-D grid, else `"collapsed"`. `"collapsed"`:
            one coarsened axis at a time,
            each fine point from its two coarse neighbours along the axis
            with weights from the stencil collapsed onto it, and `R A P` in
            closed form. `"full"` (black-box multigrid, Dendy): the points
            inside a coarse cell (fine along two or more coarsened axes)
            from all their neighbours with the whole stencil's weights, and
            `R A P` by probing (3^d applications of the transfer per level:
            a slower set-up); for coefficients that jump on small blocks
            (`docs/multigrid.md`). A level with a periodic axis whose coarse
            length is not a multiple of 3 is interpolated `"collapsed"`.
        dtype: the precision of the hierarchy and of every cycle: None (the
            operator's) or a narrower one, e.g. `jnp.float32` for a float64
            operator. The set-up casts the operator's coefficients to it;
            a cycle casts its input to it and its output back to the
            input's dtype. The Krylov method's residuals and convergence
            test stay in the operator's precision, so a float64 solve with a
            float32 cycle still reaches float64 tolerances (Poisson 1024^2:
            the same 8 CG iterations to 1e-8) at half the memory traffic
            per cycle. The preconditioner is then linear only up to float32
            rounding: CG and GMRES still reach 1e-11 and 1e-10 with it in
            at most one more iteration (tested; `docs/multigrid.md`).

        storage_dtype: the precision the hierarchy's arrays are stored in
            after set-up (every level's coefficients and interpolation
            weights): None (as computed) or a narrower real floating dtype,
            `jnp.bfloat16` or `jnp.float16` included. The set-up runs in
            `dtype` (or the operator's precision) and the cycle computes in
            it too; only the bytes each smoothing step and transfer reads
            shrink (bfloat16 keeps 3 digits of each coefficient: the cycle
            stays symmetric, a slightly different preconditioner;
            `docs/precision.md`). The coarsest level's inverse stays in
            `dtype`.

    Returns:
        A `Multigrid`: a callable `r -> z` (the `precond` of any solver) and
        a pytree; `shapes` lists the levels' grids.

    Raises:
        TypeError, ValueError: an operator that is not a `StencilOperator`,
            offsets farther than one point, an unknown cycle or smoother,
            out-of-range numbers.
    """
    if not isinstance(operator, StencilOperator):
        raise TypeError("`operator` must be a StencilOperator (from sx.stencil_operator or "
                        "sx.diffusion_operator): multigrid coarsens its stencil; got "
                        f"{type(operator).__name__}.")
    if any(abs(v) > 1 for o in operator.entries for v in o):
        raise ValueError("`operator`'s offsets must be within one point per axis (a 3-, 9- "
                         f"or 27-point stencil) for multigrid; got {sorted(operator.entries)}.")
    checks.check_choice("cycle", cycle, CYCLES)
    checks.check_choice("smoother", smoother, tuple(SMOOTHERS))
    checks.check_choice("coarse", coarse, ("auto",) + tuple(COARSE))
    checks.check_choice("interpolation", interpolation, ("auto",) + INTERPOLATIONS)
    coarse_degree = checks.check_int("coarse_degree", coarse_degree, 1)
    steps = checks.check_int("steps", steps, 1)
    interpolation, coarse, coarse_size = _resolved(operator, interpolation, coarse, coarse_size)
    coarse_size = checked_coarse_size(coarse, coarse_size, operator)
    max_levels = checks.check_int("max_levels", max_levels, 1)
    if not 0 < float(semicoarsening) <= 1:
        raise ValueError(f"`semicoarsening` must be in (0, 1]; got {semicoarsening!r}.")
    if not 0 < float(chebyshev_lower) < 1:
        raise ValueError(f"`chebyshev_lower` must be in (0, 1); got {chebyshev_lower!r}.")
    if operator.is_symmetric() is False:
        warnings.warn("multigrid: the operator is not symmetric, so its cycle is not a "
                      "preconditioner for `pcg` (which refuses it); use it with `gmres` or "
                      "`bicgstab`.", UserWarning, stacklevel=2)
    dtype, storage_dtype, narrowed = _precisions(operator, dtype, storage_dtype)
    shards, one_device = _placement(operator, shards)
    # a preconditioner changes how a solve gets there, not where: the
    # solvers' implicit adjoints do not differentiate it, so neither does
    # the set-up (no derivative of its eigenvalue estimates or gathers)
    op = jax.lax.stop_gradient(operator)
    if dtype is not None:
        op = _narrowed(op, dtype)
    levels, tail = build_hierarchy(op, coarse_size=coarse_size, max_levels=max_levels,
                                   semicoarsening=float(semicoarsening), shards=shards,
                                   interpolation=interpolation, one_device=one_device,
                                   materialize=one_device and narrowed)
    coarse_solve = COARSE[coarse].build(levels[-1].op, coarse_degree)
    if storage_dtype is not None:
        _check_storage_range(levels, storage_dtype)
        levels = [_stored_as(lv, storage_dtype) for lv in levels]
        if tail is not None:
            tail = Tail(_stored_as(tail.levels, storage_dtype), tail.shapes, tail.padded)
    return Multigrid(levels, coarse_solve, cycle, smoother, steps, float(chebyshev_lower), dtype,
                     tail)


def _narrowed(op: StencilOperator, dtype) -> StencilOperator:
    """`op` with its coefficients cast to `dtype` once, into memory, before
    the set-up reads them: without the barrier XLA fuses whatever computed
    them (the harmonic means of a float64 `diffusion_operator`, say) into
    each reader, in the wider precision, once per reader."""
    return jax.lax.optimization_barrier(jax.tree_util.tree_map(lambda c: c.astype(dtype), op))


def _resolved(operator: StencilOperator, interpolation: str, coarse: str, coarse_size) -> tuple:
    """`multigrid`'s `(interpolation, coarse, coarse_size)` with `"auto"` and
    None filled in by `rule.choose` (read only where something is left to
    choose): a `coarse_size` given with `coarse="auto"` beyond a dense
    inverse's reach asks for lines."""
    if coarse == "auto" and coarse_size is not None:
        coarse = "direct" if coarse_size <= DenseInverse.limit else "lines"
    choice = (rule.choose(operator, is_concrete(operator))
              if "auto" in (interpolation, coarse) else None)
    if interpolation == "auto":
        interpolation = choice.interpolation
    if coarse == "auto":
        coarse, coarse_size = choice.coarse, choice.coarse_size
    return interpolation, coarse, rule.PLAIN_SIZE if coarse_size is None else coarse_size


def _placement(operator: StencilOperator, shards) -> tuple:
    """`(shards, one_device)`: `multigrid`'s `shards` checked (or read from
    the coefficients' sharding), and whether the grid is known to be on one
    device (`tail_plan`): said so by `shards`, or nowhere else to be (traced
    coefficients do not tell)."""
    if shards is None:
        return shards_of(operator), target.one_device()
    if (not isinstance(shards, tuple | list) or len(shards) != operator.ndim
            or not all(isinstance(d, int) and d >= 1 for d in shards)):
        raise ValueError(f"`shards` must give, per grid axis, the number of devices splitting "
                         f"it (ints >= 1, {operator.ndim} of them); got {shards!r}.")
    return tuple(shards), all(d == 1 for d in shards)


def _precisions(operator: StencilOperator, dtype, storage_dtype) -> tuple:
    """`multigrid`'s `(dtype, storage_dtype)` checked against the operator's
    own precision (at least float32 for the set-up), and whether either
    narrows the hierarchy below it (`build_hierarchy`'s `materialize`)."""
    own = jnp.result_type(*operator.entries.values())
    if jnp.finfo(own).bits < 32:
        raise TypeError(f"`operator` has {jnp.dtype(own).name} coefficients; multigrid's "
                        "set-up needs float32 or wider. Build the operator in float32 and "
                        f"pass `storage_dtype=jnp.{jnp.dtype(own).name}` to store the hierarchy "
                        "in half precision (the cycle computes in float32).")
    if dtype is not None:
        dtype = _cycle_dtype(dtype, own)
    if storage_dtype is not None:
        storage_dtype = _storage_dtype(storage_dtype, dtype or own)
    narrowed = any(d is not None and jnp.dtype(d).itemsize < jnp.dtype(own).itemsize
                   for d in (dtype, storage_dtype))
    return dtype, storage_dtype, narrowed


def _stored_as(level: Level, dtype) -> Level:
    """A level (or a `Tail`'s stack of them) with its coefficients and
    interpolation weights stored in `dtype` (`_check_storage_range` says
    whether it holds them); its `lambda_max` stays as computed."""
    def narrow(w):
        return w.astype(dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w

    transfer = jax.tree_util.tree_map(narrow, level.transfer)
    return Level(level.op.astype(dtype), level.lmax, transfer, level.looped)


def _check_storage_range(levels: list, dtype) -> None:
    """Refuse a storage dtype that cannot hold the hierarchy's coefficients
    (concrete ones; float16 tops out at 65504, and Galerkin coefficients grow
    level by level: a 3-D field of contrast 1e3 at 96^3 reaches 3e6 on its
    coarsest level). A traced set-up cannot be checked: there a coefficient
    that overflows makes the solve's status NONFINITE."""
    if not all(is_concrete(lv.op) for lv in levels):
        return
    largest = max(float(jnp.max(jnp.abs(jnp.asarray(c)))) for lv in levels
                  for c in lv.op.stored.values())
    limit = float(jnp.finfo(dtype).max)
    if not largest < limit:
        raise ValueError(f"`storage_dtype={jnp.dtype(dtype).name}` cannot hold this hierarchy: "
                         f"its largest coefficient is {largest:.3g} (the dtype's largest "
                         f"finite value {limit:.3g}). Use `storage_dtype=jnp.bfloat16` "
                         "(float32's range, 3 digits) or a wider dtype.")


def _storage_dtype(dtype, precision):
    """`multigrid`'s `storage_dtype`: a real floating dtype no wider than the
    hierarchy's `precision` (16-bit ones included), for a real operator."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = None
    if jnp.issubdtype(precision, jnp.complexfloating):
        raise TypeError("`storage_dtype` is for real operators; a complex operator's hierarchy "
                        "is stored in its own precision (pass None).")
    if (dtype is None or not jnp.issubdtype(dtype, jnp.floating)
            or dtype.itemsize > jnp.dtype(precision).itemsize):
        raise TypeError(f"`storage_dtype` must be None or a real floating dtype no wider than "
                        f"the hierarchy's {jnp.dtype(precision).name}, e.g. jnp.bfloat16 or "
                        f"jnp.float16; got {dtype!r}.")
    return dtype


def _cycle_dtype(dtype, own):
    """`multigrid`'s `dtype` checked against the operator's own `own`: a
    floating (complex for a complex operator) dtype of 32 bits or more."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = None
    complex_operator = jnp.issubdtype(own, jnp.complexfloating)
    kind = jnp.complexfloating if complex_operator else jnp.floating
    if dtype is None or not jnp.issubdtype(dtype, kind) or jnp.finfo(dtype).bits < 32:
        example = "jnp.complex64" if complex_operator else "jnp.float32"
        raise TypeError(f"`dtype` must be None (the operator's {jnp.dtype(own).name}) or a "
                        f"{'complex' if complex_operator else 'real'} floating dtype of 32 bits "
                        f"or more such as {example}.")
    return jax.dtypes.canonicalize_dtype(dtype)
