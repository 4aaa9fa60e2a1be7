"""Multigrid forms on the current backend (a TPU chip): MG-CG's first call,
its warm solve and one V-cycle for the library's form and for forms it
does not take yet (issue 51: first calls at most 10 s, a V-cycle at most 8
CG steps, launch-bound coarse levels).

`python benchmarks/probe_multigrid_forms.py [--out DIR] [--forms NAME ...] N ...`
prints, per 2-D grid size (Poisson, float32, MG-CG to 1e-5 as in
`accelerator_speed.py`) and form: the first call (trace, compile, run; a
small MG-CG compiled before, so no form pays the process's first compile),
iterations and status, the warm solve and V-cycle (interleaved rounds), and
the cycle program's kernels (instructions that launch one). `DIR/multigrid_forms.json`
holds the numbers.

The forms, each patched in while its programs are traced:
- `library`: as built;
- `tail 1/16`, `tail 1/4`: the coarse levels written once (`Tail`) from the
  first with at most 1/16 (1/4) of the finest grid's points, not 1/64:
  fewer levels compiled one by one, more padded work (on this CPU at 1024^2,
  1/16 compiled about 1.4 s faster and its set-up took 23 ms more);
- `strided`: every-other-point sampling as a strided slice and the
  interleaving of prolongation as interior padding, where the library pairs
  points by a reshape into `(n/2, 2)` (on a TPU that reshape laid the
  transfers' arrays out transposed, and layout copies ran every cycle:
  `results/tpu.md`; on a sharded axis JAX 0.4.38's partitioner made a
  gather of a strided slice, so this is a one-device form);
- `strided, tail 1/4`: both;
- `smoothing unrolled`: each smoother's steps unrolled in Python, as before
  they became a loop on one device (`Level.repeated`: on this CPU at
  1024^2 the same warm time, and the same program at the default 2 steps
  but for the post-smoothing's loop)."""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from accelerator_speed import NO_KERNEL, _mg_case
from problems import probe_meta, write_probe

import solvax as sx
from solvax._accounting import counter
from solvax._grid.multigrid import fusion, galerkin, hierarchy, levels, transfer

ROUNDS = 5


def every_other(x, axis: int, phase: int):
    """`transfer.every_other` as a strided slice."""
    return jax.lax.slice_in_dim(x, phase, x.shape[axis], stride=2, axis=axis)


def spaced(v, axis: int, n: int, phase: int):
    """`v` at the points `phase, phase + 2, ...` of an axis of `n` points,
    zero between them: one pad with interior padding."""
    config = [(0, 0, 0)] * v.ndim
    config[axis] = (phase, n - 1 - phase - 2 * (v.shape[axis] - 1), 1)
    return jax.lax.pad(v, jnp.zeros((), v.dtype), config)


def placed(v, phases: tuple, shape: tuple):
    """`transfer.placed` by interior padding."""
    for axis, phase in phases:
        v = spaced(v, axis, shape[axis], phase)
    return v


def prolong_axis(c, axis: int, n: int, periodic: bool, weights: dict, name=None):
    """`transfer._prolong_axis` with its interleaving by interior padding."""
    nc = c.shape[axis]
    left = transfer.unit_shift(c, axis, -1, "periodic" if periodic else "dirichlet", name)
    evens = (transfer.axis_slice(weights["minus"], axis, 0, nc) * left
             + transfer.axis_slice(weights["plus"], axis, 0, nc) * c)
    fine = spaced(evens, axis, 2 * nc, 0) + spaced(c, axis, 2 * nc, 1)
    if n == 2 * nc:
        return fine
    last = (transfer.axis_slice(weights["minus"], axis, nc, nc + 1)
            * transfer.axis_slice(c, axis, nc - 1, nc))
    return jnp.concatenate([fine, last], axis=axis)


def unrolled(self, step, times: int, x):
    """`levels.Level.repeated` unrolled in Python on every grid."""
    return fusion.repeated(step, times, x, loop=False)


#: per form, `(module, name, value)` patched while its programs are traced
FORMS = {
    "library": [],
    "tail 1/16": [(hierarchy, "_TAIL_FRACTION", 16)],
    "tail 1/4": [(hierarchy, "_TAIL_FRACTION", 4)],
    "strided": [(transfer, "every_other", every_other), (galerkin, "every_other", every_other),
                (transfer, "placed", placed), (transfer, "_prolong_axis", prolong_axis)],
}
FORMS["strided, tail 1/4"] = FORMS["strided"] + FORMS["tail 1/4"]
FORMS["smoothing unrolled"] = [(levels.Level, "repeated", unrolled)]


def patched(form: str, fn):
    """`fn()` with `form`'s patches in place (JAX's caches cleared first:
    the set-up's jitted steps would keep another form's traces)."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in FORMS[form]]
    jax.clear_caches()
    for module, name, value in FORMS[form]:
        setattr(module, name, value)
    try:
        return fn()
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def kernels(text: str) -> int:
    """Instructions of optimized HLO `text` that launch a kernel: those of
    every computation but the ones a fusion calls (`counter._parse`, as
    `accelerator_speed.step_kernels` reads a step)."""
    comps, _ = counter._parse(text)
    fused = {c for instrs in comps.values() for _, _, opcode, rest in instrs
             if opcode == "fusion" for c in counter.callees(rest)}
    return sum(opcode not in NO_KERNEL for comp, instrs in comps.items() if comp not in fused
               for _, _, opcode, _ in instrs)


def programs(form: str, n: int) -> dict:
    """Form `form`'s row at `n^2` without its warm times, and its compiled
    `solve` and `cycle` with their arguments."""
    def build():
        k, b, _, hierarchy_of, solve = _mg_case(f"2-D {n}^2 V")
        jax.block_until_ready((k, b))
        start = time.perf_counter()
        solve_c = jax.jit(solve).lower(k, b).compile()
        sol = jax.block_until_ready(solve_c(k, b))
        first = time.perf_counter() - start
        M = jax.jit(hierarchy_of)(k)
        cycle_c = jax.jit(lambda M, b: M(b)).lower(M, b).compile()
        row = {"first_s": first, "iterations": int(sol.iterations),
               "status": sx.Status(int(sol.status)).name, "levels": len(M.levels),
               "cycle_kernels": kernels(cycle_c.as_text())}
        return row, {"solve": (solve_c, (k, b)), "cycle": (cycle_c, (M, b))}

    return patched(form, build)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sizes", nargs="+", type=int)
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = {"meta": probe_meta()}
    programs("library", 32)   # the process's first compile, paid here
    for n in args.sizes:
        rows, compiled = {}, {}
        for form in args.forms:
            rows[form], compiled[form] = programs(form, n)
            print(f"{n} {form}: first call {rows[form]['first_s']:.1f} s, "
                  f"{rows[form]['iterations']} iterations ({rows[form]['status']}), "
                  f"{rows[form]['cycle_kernels']} cycle kernels", flush=True)
        times = {(form, what): [] for form in compiled for what in compiled[form]}
        for _ in range(ROUNDS):
            for (form, what), ts in times.items():
                fn, fn_args = compiled[form][what]
                start = time.perf_counter()
                jax.block_until_ready(fn(*fn_args))
                ts.append(time.perf_counter() - start)
        for (form, what), ts in times.items():
            rows[form][f"{what}_ms"] = 1e3 * float(np.median(ts))
        for form, row in rows.items():
            print(f"{n} {form}: solve {row['solve_ms']:.3f} ms, V-cycle {row['cycle_ms']:.3f} ms "
                  f"({row['solve_ms'] / rows[args.forms[0]]['solve_ms']:.2f}x and "
                  f"{row['cycle_ms'] / rows[args.forms[0]]['cycle_ms']:.2f}x {args.forms[0]})",
                  flush=True)
        result[str(n)] = rows
    write_probe(args.out, "multigrid_forms.json", result)


if __name__ == "__main__":
    main()
