"""Is a traced `matvec` linear in its argument? A trace-time scan of its jaxpr.

A Krylov method needs `A(a x + y) = a A(x) + A(y)`; a function such as
`lambda x: lap(x) + x**3` returned a generic STAGNATION, and `jax.grad`
failed deep inside JAX (no transpose rule for `integer_pow`). The scan marks
every value that depends on the argument and reports the first primitive
that is not linear in what depends on it: a power, an elementwise
nonlinearity, a comparison (a branch on the argument), a product or quotient
of two dependent values. Higher-order primitives whose inner programs it does
not map (loops, conditionals, `shard_map`) pass their dependence through
unchecked, so it never refuses a linear operator; it catches the common
mistakes.
"""

from __future__ import annotations

import jax

# nonlinear in any dependent operand
_NONLINEAR = {
    "integer_pow", "pow", "square", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "log", "log1p",
    "expm1", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh",
    "asinh", "acosh", "atanh", "logistic", "erf", "erfc", "erf_inv", "lgamma", "digamma",
    "abs", "sign", "floor", "ceil", "round", "max", "min", "rem", "is_finite", "gt", "lt",
    "ge", "le", "eq", "ne", "argmax", "argmin", "reduce_max", "reduce_min", "sort",
}
# bilinear: nonlinear when more than one operand depends on the argument
_BILINEAR = {"mul", "dot_general", "conv_general_dilated"}


def _called_jaxpr(eqn):
    """The inner jaxpr of a call-like primitive whose inputs map one to one."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
            return inner
    return None


def first_nonlinearity(jaxpr, dependent: list[bool]) -> str | None:
    """The first primitive (name and where) not linear in `jaxpr`'s inputs
    marked `dependent`, or None."""
    depends = {v for v, d in zip(jaxpr.invars, dependent) if d}

    def dep(v):
        return not hasattr(v, "val") and v in depends

    for eqn in jaxpr.eqns:
        flags = [dep(v) for v in eqn.invars]
        if not any(flags):
            continue
        name = eqn.primitive.name
        where = jax._src.source_info_util.summarize(eqn.source_info)
        if name in _NONLINEAR or (name in _BILINEAR and sum(flags) > 1) \
                or (name == "div" and flags[1]):
            return f"`{name}` at {where}"
        inner = _called_jaxpr(eqn)
        if inner is not None:
            found = first_nonlinearity(inner, flags)
            if found:
                return found
        depends.update(eqn.outvars)
    return None


def check_linear(name: str, program) -> None:
    """Refuse the argument `name` when its traced `program` (a closed jaxpr of
    the function at a vector) is not linear in its inputs."""
    found = first_nonlinearity(program.jaxpr, [True] * len(program.jaxpr.invars))
    if found:
        raise ValueError(
            f"`{name}` is not linear in its argument: {found} applies a nonlinear operation "
            "to it. Krylov solvers need a linear operator x -> A x; for a nonlinear system "
            "F(x) = 0 use `solvax.newton_krylov`, and for a Jacobian-vector product use "
            "`jax.linearize` or `jax.jvp`.")
