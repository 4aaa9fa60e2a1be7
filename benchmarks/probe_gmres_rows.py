"""GMRES(30) per matvec with `reduce.reads_rows_in_use` patched off and on,
for each orthogonalization, against jax.scipy's gmres (upwind
convection-diffusion, float32, a fixed 300 matvecs, 5 interleaved rounds).

`python benchmarks/probe_gmres_rows.py [--out DIR] N ...` prints, per grid
size and form, the milliseconds per matvec and the ratio to jax.scipy's,
and the sliced basis blocks XLA copied into memory instead of fusing into
the sums that read them (slices of two or more basis rows outside fused
computations in the optimized HLO: on a TPU a sum of two coefficient
vectors at once had them, the form one-sync no longer takes; sums of one
vector each, as both orthogonalizations now run, did not). `DIR/gmres_rows.json`
holds the numbers. The form `one_sync rows in use, one reduce` (not in the
library) sums one-sync's coefficient vectors on the rows in use as the two
outputs of one variadic `lax.reduce` per leaf, whose operands both multiply
the sliced block: one multi-output reduction that should read the rows once
where two sums read them twice. On a CPU the rule is off by default and XLA:CPU copies
every sliced GEMV operand (see `reduce.reads_rows_in_use`)."""
import argparse
import re
import time

import jax
import jax.numpy as jnp
import jax.scipy.sparse.linalg as jsl
import numpy as np
from accelerator_speed import DTYPE, FAR, convection
from problems import probe_meta, write_probe

import solvax as sx
from solvax._core import reduce, tree
from solvax._krylov import arnoldi

STEPS, RESTART, ROUNDS = 300, 30, 5
#: a slice of two or more basis rows
BLOCK = re.compile(r"^\s*%slice[.\d]* = \w+\[(?:[2-9]|\d\d+),\d+,\d+[\],]")


def copied_blocks(text: str) -> int:
    """Slices of two or more basis rows outside fused computations in
    optimized HLO `text`: each one a copy into memory of its own."""
    count, fused = 0, False
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            fused = head.group(1).startswith("fused")
        elif not fused and BLOCK.match(line):
            count += 1
    return count


def one_reduce(basis, coeffs: list, used) -> list:
    """`arnoldi._combined` with the rows in use summed by one variadic reduce
    per leaf (every coefficient vector an operand of it)."""
    def combine(size):
        if size is None:
            return tree.basis_combine_many(basis, coeffs)

        def leafwise(leaf):
            leaf = leaf[:size]
            shape = (size,) + (1,) * (leaf.ndim - 1)
            ops = tuple(tree.like(c[:size], leaf).reshape(shape) * leaf for c in coeffs)
            return jax.lax.reduce(ops, tuple(jnp.zeros((), o.dtype) for o in ops),
                                  lambda a, b: tuple(x + y for x, y in zip(a, b)), (0,))

        sums = [leafwise(leaf) for leaf in jax.tree_util.tree_leaves(basis)]
        structure = jax.tree_util.tree_structure(basis)
        return [jax.tree_util.tree_unflatten(structure, [s[i] for s in sums])
                for i in range(len(coeffs))]

    return arnoldi.on_rows(combine, used, coeffs[0].shape[0])


def forms():
    """`(name, orthogonalization, rows_in_use, combination)` of each solvax
    contender (`combination`: None, the library's, or `one_reduce`)."""
    for orth in ("one_sync", "cgs2"):
        for rows in (False, True):
            yield f"{orth} {'rows in use' if rows else 'every row'}", orth, rows, None
    yield "one_sync rows in use, one reduce", "one_sync", True, one_reduce


def compiled(n: int, b):
    out, copied = {}, {}
    for name, orth, rows, combination in forms():
        rule, combined = reduce.reads_rows_in_use, arnoldi._combined
        reduce.reads_rows_in_use = lambda *a, _r=rows, **k: _r
        arnoldi._combined = combination or combined
        try:   # a new closure: traced under this value of the rule
            fn = jax.jit(lambda b, o=orth: sx.gmres(lambda v: convection(v), b, rtol=FAR,
                                                    restart=RESTART,
                                                    max_restarts=STEPS // RESTART,
                                                    orthogonalization=o).x)
            out[name] = fn.lower(b).compile()
        finally:
            reduce.reads_rows_in_use, arnoldi._combined = rule, combined
        copied[name] = copied_blocks(out[name].as_text())
    out["jax.scipy"] = jax.jit(lambda b: jsl.gmres(
        convection, b, tol=0.0, atol=0.0, restart=RESTART, maxiter=STEPS // RESTART,
        solve_method="batched")[0]).lower(b).compile()
    copied["jax.scipy"] = copied_blocks(out["jax.scipy"].as_text())
    return out, copied


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sizes", nargs="+", type=int)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = {"meta": probe_meta()}
    for n in args.sizes:
        b = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), DTYPE)
        programs, copied = compiled(n, b)
        times = {name: [] for name in programs}
        for c in programs.values():
            jax.block_until_ready(c(b))
        for _ in range(ROUNDS):
            for name, c in programs.items():
                t = time.perf_counter()
                jax.block_until_ready(c(b))
                times[name].append(time.perf_counter() - t)
        ms = {name: 1e3 * float(np.median(t)) / STEPS for name, t in times.items()}
        result[str(n)] = {name: {"ms_per_matvec": ms[name], "ratio": ms[name] / ms["jax.scipy"],
                                 "copied_slices": copied[name]} for name in programs}
        for name, row in result[str(n)].items():
            print(f"{n} {name}: {row['ms_per_matvec']:.4f} ms per matvec, "
                  f"{row['ratio']:.3f}x jax.scipy, {row['copied_slices']} copied slices",
                  flush=True)
    write_probe(args.out, "gmres_rows.json", result)


if __name__ == "__main__":
    main()
