"""The options the solvers share, defined once: their names, their checks and
their documentation.

Every public solver keeps explicit keywords in its signature (for users and
editors); what they mean and how they are checked lives here:

- `COMMON`: the entries of the options every solver documents alike,
  inserted into each solver's docstring by `documented` where it says
  `COMMON_MARKER` (its own options keep their own entries);
- `checked_loop_options`: `max_steps` and `record_history`, checked for every
  method the driver runs; `failed_derivative` by `checked_failed_derivative`
  (tolerances, `x0` and the inner product in `validation.make_problem`);
- `SET_BY_NEWTON`: the options `newton_krylov` sets on its inner solver itself.
"""

from __future__ import annotations

import functools
import inspect
import textwrap

from . import checks

#: The `failed_derivative=` choices.
FAILED_DERIVATIVES = ("nan", "keep")

#: The entries every solver's docstring shares, in the order they are listed.
COMMON = {
    "x0": "initial guess shaped like `b` (default zeros).",
    "rtol, atol": "stop when `||b - A x|| <= max(atol, rtol * ||b||)`. The default `rtol` "
                  "depends on the precision of `b`: `max(1e-8, 100 eps)` for its least "
                  "precise leaf, 1e-8 in float64 and 1.2e-5 in float32 (1e-8 is out of "
                  "float32's reach: its rounding level is 6e-8).",
    "inner_product": "a `solvax.InnerProduct` (or `(x, y) -> scalar`) used for every product "
                     "and norm, including the stopping test.",
    "axis_name": "inside `shard_map`, the mesh axis the vectors are split over (shorthand for "
                 "`inner_product=InnerProduct(axis_name=...)`).",
    "failed_derivative": "`\"nan\"` (default): a derivative (`jax.grad`, `jax.jvp`) whose "
                         "tangent or transposed solve did not converge is NaN, so a finite "
                         "derivative is a correct one; `\"keep\"`: as computed.",
}

#: The line of a solver's `Args:` section that `documented` replaces by `COMMON`.
COMMON_MARKER = ("x0, rtol, atol, inner_product, axis_name, failed_derivative: the common "
                 "options.")

#: The options of an inner solver that `newton_krylov` sets itself.
SET_BY_NEWTON = ("x0", "precond", "rtol", "atol", "max_steps", "max_restarts", "inner_product",
                 "axis_name", "failed_derivative", "record_history", "recycle")


#: Keywords of jax.scipy, SciPy and lineax that solvax spells otherwise: the
#: solvax name (or what to do instead) a refusal names.
FOREIGN = {
    "tol": "`rtol` (jax.scipy's and SciPy's `tol` is solvax's `rtol`)",
    "maxiter": "`max_steps` (iterations; GMRES: `max_restarts` cycles of `restart` steps)",
    "M": "`precond` (a function `r -> M r`)",
    "callback": "`record_history=True` (the residual norm per step in `Solution.history`)",
    "solve_method": "`orthogonalization` (GMRES: 'one_sync', 'cgs2' ...)",
    "norm": "`inner_product` (its norm is used for every test)",
    "throw": "`sol.check()` on the host (raises unless it converged)",
    "options": "keywords (solvax's options are keyword arguments)",
    "max_iter": "`max_steps`",
    "maxiters": "`max_steps`",
}


def refuse_foreign(fn):
    """`fn` refusing, with the solvax name to use, a keyword of jax.scipy,
    SciPy or lineax (`FOREIGN`) that it does not take itself."""
    taken = inspect.signature(fn).parameters

    @functools.wraps(fn)
    def solver(*args, **kwargs):
        for name in kwargs:
            if name in FOREIGN and name not in taken:
                raise TypeError(f"{fn.__name__}() got the keyword `{name}`, which solvax does "
                                f"not take: use {FOREIGN[name]}.")
        return fn(*args, **kwargs)

    return solver


def documented(fn):
    """`fn` with `COMMON_MARKER` in its docstring replaced by the `COMMON`
    entries (each option `fn` takes), indented as the marker is, and
    refusing the foreign keywords (`refuse_foreign`)."""
    doc = fn.__doc__ or ""
    lines = doc.split("\n")
    at = [i for i, line in enumerate(lines) if line.strip() == COMMON_MARKER]
    if len(at) != 1:
        raise ValueError(f"{fn.__name__}'s docstring must hold the common-options marker once")
    indent = lines[at[0]][:len(lines[at[0]]) - len(lines[at[0]].lstrip())]
    taken = inspect.signature(fn).parameters
    # the entries the docstring gives itself (an option with a meaning of its own there)
    own = {line.split(":")[0].strip() for line in lines
           if line.startswith(indent) and line[len(indent):][:1].strip() and ":" in line}
    entries = []
    for names, text in COMMON.items():
        if names not in own and all(name.strip() in taken for name in names.split(",")):
            entries += textwrap.wrap(f"{names}: {text}", 88 - len(indent),
                                     subsequent_indent="    ", break_on_hyphens=False)
    lines[at[0]:at[0] + 1] = [indent + entry for entry in entries]
    fn.__doc__ = "\n".join(lines)
    return refuse_foreign(fn)


def checked_failed_derivative(value: str) -> str:
    checks.check_choice("failed_derivative", value, FAILED_DERIVATIVES)
    return value


def checked_loop_options(options: dict) -> dict:
    """The loop options several methods share, checked once: `max_steps` a
    non-negative int (or None), `record_history` a bool."""
    if options.get("max_steps") is not None:
        checks.check_int("max_steps", options["max_steps"], 0)
    if "record_history" in options:
        options = {**options, "record_history": checks.check_flag(
            "record_history", options["record_history"])}
    return options
