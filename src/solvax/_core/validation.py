"""A solve's inputs checked at trace time and closure-converted: `b`,
`x0`, the operator and preconditioner (shapes, dtypes, linearity), the
tolerances and the inner product (`make_problem`; shared by the Krylov
driver, `linear_solve` and `newton_krylov`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import checks, linearity, reduce
from .closure import Closed, axes_communicated, close
from .contract import Problem, as_option


def default_rtol(b) -> float:
    """`max(1e-8, 100 eps)` for the least precise leaf of `b`: 1e-8 in float64,
    1.2e-5 in float32 (a float32 leaf limits the accuracy of the whole solve)."""
    return max([1e-8] + [100 * float(jnp.finfo(leaf.dtype).eps)
                         for leaf in jax.tree_util.tree_leaves(b)])


def make_problem(matvec, b, *, x0=None, precond=None, rtol=0.0, atol=0.0, inner_product=None,
                 axis_name=None) -> Problem:
    """The validated, closure-converted problem (see the module docstring, 1-2)."""
    checks.check_vector("b", b)
    checks.check_precision("b", b)
    checks.check_callable("matvec", matvec)
    b = checks.strong(b)
    if x0 is not None:
        checks.check_like("x0", x0, "b", b)
        x0 = checks.strong(x0)
    rtol = checked_tolerances(rtol, atol, b)
    ip = resolved_inner_product(inner_product, axis_name, b)
    return Problem(A=closed_operator("matvec", matvec, b, linear=True), b=b, x0=x0,
                   precond=None if precond is None else closed_operator("precond", precond, b),
                   rtol=as_option(rtol), atol=as_option(atol), ip=ip)


def checked_tolerances(rtol, atol, like):
    """`rtol` (its default for `like`'s precision when None), both tolerances
    checked where concrete."""
    rtol = default_rtol(like) if rtol is None else rtol
    checks.check_tolerance("rtol", rtol)
    checks.check_tolerance("atol", atol)
    return rtol


def resolved_inner_product(inner_product, axis_name, like) -> reduce.Reduction:
    """The `inner_product=`/`axis_name=` options as a reduction, closed over
    vectors like `like` and checked (`check_inner_product`)."""
    ip = reduce.resolve(inner_product, axis_name)
    with checks.failures_named("inner_product"):
        ip = ip.closed(like)
    check_inner_product(ip, like)
    return ip


def closed_operator(name: str, fn, b, arg: str = "b", linear: bool = False) -> Closed:
    """`fn` as a `Closed`, its output checked against `b` and, with `linear`,
    its program checked linear in its argument (`linearity.py`), both on one
    trace of the converted function (the user's function is traced once);
    `arg`: `b`'s name in errors."""
    checks.check_callable(name, fn)
    with checks.failures_named(name):
        A = close(fn, b)
    program, out = jax.make_jaxpr(A, return_shape=True)(b)
    checks.check_like(f"{name}({arg})", out, arg, b)
    if linear:
        linearity.check_linear(name, program)
    return A


def check_inner_product(ip: reduce.Reduction, b) -> None:
    """Weights shaped like `b` and positive; a callable product (closed: its
    function is not traced again here) returns a scalar; `axis_name` names
    axes of the enclosing `shard_map`."""
    if isinstance(ip, reduce.InnerProduct):
        if ip.weight is not None:
            checks.check_shapes_like("inner_product.weight", ip.weight, "b", b)
            checks.check_positive("inner_product.weight", ip.weight)
        _check_axes_bound(ip.reduced_axes())
        return
    out = jax.eval_shape(ip.fn, b, b)
    if jax.tree_util.tree_structure(out).num_leaves != 1 or jnp.shape(out) != ():
        raise ValueError("`inner_product(x, y)` must return a scalar; on vectors shaped like "
                         f"`b` it returns {jax.tree_util.tree_map(jnp.shape, out)}. Reduce "
                         "over every entry (e.g. `jnp.sum(jnp.conj(x) * w * y)`).")


def check_reduced_over(name: str, op, problem: Problem) -> None:
    """An operator that communicates over a mesh axis (a halo exchange inside
    `shard_map`) couples the shards, so the inner products must reduce over
    that axis too: otherwise every shard decides convergence on its own piece,
    the shards' loops run different numbers of steps and the operator's
    collectives never match (a hang)."""
    communicated = axes_communicated(jax.make_jaxpr(op)(problem.b).jaxpr)
    missing = communicated - set(problem.ip.reduced_axes())
    if not missing:
        return
    axis = sorted(missing)[0]
    if isinstance(problem.ip, reduce.InnerProduct):
        raise ValueError(
            f"`{name}` communicates over the mesh axes {sorted(missing)} (inside `shard_map`), "
            f"but the inner products do not reduce over them: every shard would solve its "
            f"own piece. Pass `axis_name={axis!r}` (or an `InnerProduct` with that "
            "`axis_name`).")
    raise ValueError(
        f"`{name}` communicates over the mesh axes {sorted(missing)} (inside `shard_map`), but "
        f"the callable `inner_product` does not reduce over them: each shard would decide "
        f"convergence on its own piece and the solve would hang. Sum over the axis in the "
        f"product, e.g. `lambda x, y: jax.lax.psum(jnp.sum(jnp.conj(x) * y), {axis!r})`, or "
        f"use the default product with `axis_name={axis!r}`.")


def _check_axes_bound(axes: tuple) -> None:
    """Each of `axes` is an axis of the `shard_map` this call runs in."""
    for name in axes:
        try:
            jax.eval_shape(lambda name=name: jax.lax.psum(1, name))
        except NameError as e:
            raise ValueError(
                f"`axis_name` {name!r} is not an axis of an enclosing `shard_map` ({e}). "
                "Pass the mesh axis the vectors are split over, from inside `shard_map`; "
                "under plain `jit` leave `axis_name` unset.") from e
