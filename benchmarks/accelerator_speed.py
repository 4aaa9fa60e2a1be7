"""Speed on the current backend (a TPU chip): Krylov steps, multigrid, recycling.

`python benchmarks/accelerator_speed.py [--small] [--out DIR] [--only TEXT ...] [--sizes N ...]
[--cases TEXT ...] [--fresh]`

One process, float32, solvax and its peers interleaved (each round runs every
contender once; medians of the rounds, `problems.interleaved`). Parts (`--only`):

- `triad`: `1.5 x + z` on 2^26 floats, the practical bandwidth (GB/s).
- `krylov`: a fixed number of steps (rtol far below reach), milliseconds per
  step, on the 5-point Poisson problem at 1024^2, 2048^2 and 4096^2: pcg
  (standard, single_reduction, pipelined) against `jax.scipy`'s cg; on upwind
  convection-diffusion at 2048^2: gmres(30) (one_sync, cgs2) against
  `jax.scipy`'s batched gmres per matvec, bicgstab (standard, one_sync)
  against `jax.scipy`'s bicgstab per step. Each row prints its ratio to the
  peer beside the vector passes per step the method needs (`PASSES`: reads
  plus writes of a grid-sized vector, a 5-point matvec counted as 2) and the
  time those passes take at the measured triad bandwidth.
- `tolerance`: at 2048^2 each Krylov method to rtol 1e-4 against its peer
  (time, iterations, true relative residual): every round of the methods
  that confirm convergence on the true residual runs.
- `multigrid`: MG-CG (`pcg` with `multigrid`, V, W and F cycles) on Poisson
  at 1024^2 to 4096^2 and 128^3: first call (trace + compile + run), warm
  solve, one V-cycle against one plain CG step of the same size, the
  V-cycle's bytes model (`cycle_passes`) at the triad bandwidth; `--cases`
  keeps the cases whose label (`2-D 2048^2 W`) contains one of its texts;
  `--fresh` measures each case's first call again in a process of its own
  (`--first-call LABEL` prints just that), since what a process compiled
  before moves a first call by seconds on a TPU.
- `precision` (run last: it turns on x64): Poisson at 2048^2 and 4096^2,
  set-up included, to a float64 true relative residual of 1e-10 (checked in
  float64 NumPy on the host): `iterative_refinement` with float32 MG-CG
  corrections, beside float32 MG-CG to its own floor (rtol 1e-7, which
  float32 stops short of: STAGNATION) and all-float64 MG-CG (emulated on a
  TPU, at 2048^2 only there, alone, after the pairs of every size: its
  compile takes minutes; `--pairs-only` leaves it out); `--sizes` picks the
  grid sizes;
  the refinement's time over the float32 solve's (issue 51 target 4: at
  most 2x).
- `recycling`: 12 backward-Euler steps of a slowly varying
  convection-diffusion at 96^2 (warm starts, rtol 1e-5): gmres(30), gcrot
  cold and gcrot recycled, total matvecs and time.

Writes `accelerator_speed.json` and `<backend>_speed.md` under `--out`,
again after every part (a run stopped by a time limit keeps the parts it
finished).
`--small` runs every part at tiny sizes on any backend (CI's smoke test).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import jax.scipy.sparse.linalg as jsl
import numpy as np
from problems import (
    cell_relative_residual,
    convection_diffusion,
    interleaved,
    poisson,
    sequence_matvecs,
)

import solvax as sx
from solvax._accounting import counter

#: HLO instructions that launch no kernel of their own
NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
             "opt-barrier", "partition-id", "replica-id"}

convection = convection_diffusion(10.0)
DTYPE = jnp.float32
HLO_DIR = None  # --hlo: where each Krylov contender's optimized HLO is written
FAR = 1e-30  # an rtol no float32 solve reaches: the step limit ends every solve

#: Vector passes per step (reads + writes of a grid-sized vector; a 5-point
#: matvec reads its input and writes its output: 2), without a
#: preconditioner, each update and each product one pass over its vectors.
PASSES = {
    # p = r + beta p (3), q = A p (2), <p, q> (2), x += alpha p (3), r -= alpha q (3), <r, r> (1)
    "pcg": 14, "jax.scipy cg": 14,
    # w = A r (2), <r, r>, <r, w> (2), p (3), s = w + beta s (3), x (3), r (3)
    "pcg single_reduction": 16,
    # Ghysels–Vanroose: n = A w (2), <r, r>, <w, r> (2), z, s, p (9), x, r, w (9)
    "pcg pipelined": 22,
    # 2 matvecs (4), p (4), s (3), x (4), r (3), products of r0 with v, s, t and
    # of v, r, s, t with themselves or each other (13); jax.scipy's six (9)
    "bicgstab": 31, "jax.scipy bicgstab": 27,
    # one-sync BiCGStab (Krasnopolsky): two more recurrences (6) and 2 products more
    "bicgstab one_sync": 39,
}


def gmres_passes(m: int, reorthogonalize: bool) -> float:
    """Passes per Arnoldi step of GMRES(m), averaged over a cycle: the matvec
    (2), the projections on the j + 1 basis vectors (j + 2 reads), the update
    (j + 3), the normalization (2); twice the projection with CGS2."""
    per = [2 + (2 if reorthogonalize else 1) * (2 * j + 5) + 2 for j in range(m)]
    return sum(per) / m


def cycle_passes(levels: int, steps: int = 2, dims: int = 2) -> float:
    """A V(steps, steps) cycle's fine-grid-vector passes: per level a Jacobi
    sweep reads x, b and writes x with the matvec fused (3), the residual
    (3), restriction (1 + 1 / 2^dims), prolongation and correction (3), each
    coarser level 2^-dims of the one above."""
    per_level = 2 * steps * 3 + 3 + (1 + 2.0 ** -dims) + 3
    return per_level * sum(2.0 ** (-dims * i) for i in range(levels))


def emit(rows: list, row: dict) -> None:
    """`row` appended to its part's `rows` and printed at once (a part's
    cases can take minutes each: multigrid's first calls on a chip)."""
    rows.append(row)
    print(json.dumps(row), flush=True)


def triad(small: bool) -> dict:
    n = 2**16 if small else 2**26
    x = jnp.ones(n, DTYPE)
    z = jnp.full(n, 2.0, DTYPE)
    seconds = interleaved({"triad": lambda x, z: 1.5 * x + z}, x, z, rounds=10)["triad"]
    gbs = 3 * n * x.dtype.itemsize / seconds / 1e9
    return {"floats": n, "seconds": seconds, "GB/s": gbs}


def _steps(solve, steps):
    """A solve of exactly `steps` steps (rtol out of reach) returning x and its step count."""
    def run(b):
        s = solve(b, steps)
        return s.x, s.iterations
    return run


def krylov(small: bool, bandwidth: float) -> list[dict]:
    steps = 60 if small else 300
    restart = 30
    rows = []
    for n in (32, 64) if small else (1024, 2048, 4096):
        symmetric = {
            "pcg": lambda b, k: sx.pcg(poisson, b, rtol=FAR, max_steps=k),
            "pcg single_reduction": lambda b, k: sx.pcg(poisson, b, rtol=FAR, max_steps=k,
                                                        single_reduction=True),
            "pcg pipelined": lambda b, k: sx.pcg(poisson, b, rtol=FAR, max_steps=k,
                                                 method="pipelined"),
        }
        peers = {"jax.scipy cg": lambda b: (jsl.cg(poisson, b, tol=0.0, atol=0.0,
                                                   maxiter=steps)[0], steps)}
        rows += _per_step(f"Poisson {n}^2", n, symmetric, peers, "jax.scipy cg", steps,
                          bandwidth)
    n = 64 if small else 2048
    nonsymmetric = {
        "gmres(30)": lambda b, k: sx.gmres(convection, b, rtol=FAR, restart=restart,
                                           max_restarts=k // restart),
        "gmres(30) cgs2": lambda b, k: sx.gmres(convection, b, rtol=FAR, restart=restart,
                                                max_restarts=k // restart,
                                                orthogonalization="cgs2"),
    }
    peers = {"jax.scipy gmres(30)": lambda b: (jsl.gmres(
        convection, b, tol=0.0, atol=0.0, restart=restart, maxiter=steps // restart,
        solve_method="batched")[0], steps)}
    rows += _per_step(f"convection-diffusion {n}^2", n, nonsymmetric, peers,
                      "jax.scipy gmres(30)", steps, bandwidth)
    short = {
        "bicgstab": lambda b, k: sx.bicgstab(convection, b, rtol=FAR, max_steps=k),
        "bicgstab one_sync": lambda b, k: sx.bicgstab(convection, b, rtol=FAR, max_steps=k,
                                                      method="one_sync"),
    }
    peers = {"jax.scipy bicgstab": lambda b: (jsl.bicgstab(convection, b, tol=0.0, atol=0.0,
                                                           maxiter=steps)[0], steps)}
    rows += _per_step(f"convection-diffusion {n}^2", n, short, peers, "jax.scipy bicgstab",
                      steps, bandwidth)
    return rows


def step_kernels(text: str) -> dict:
    """Kernels per step of a compiled solve (optimized HLO `text`): the
    instructions of its step loop's body that launch one (a fusion counts
    once; a conditional counts its costlier branch, a nested call its
    callee), and of those the `vector` ones (an array result; a TPU runs the
    scalar ones on its scalar unit, about 0.1 us each as measured). The step
    loop is the deepest `while`, the costliest of those. Returns
    `{"kernels": n, "vector": v, "opcodes": {opcode: count}, "loops": [...]}`."""
    comps, entry = counter._parse(text)

    def kernels(comp, seen=()):
        found = {}
        if comp in seen:
            return found
        for _, shape, opcode, rest in comps.get(comp, []):
            if opcode in NO_KERNEL:
                continue
            if opcode in ("conditional", "call"):
                inner = [kernels(c, seen + (comp,)) for c in counter.callees(rest)]
                best = max(inner, key=lambda k: sum(k.values()), default={})
                for k, v in best.items():
                    found[k] = found.get(k, 0) + v
                continue
            found[opcode] = found.get(opcode, 0) + 1
            if re.search(r"\[\d", shape):  # writes an array: a vector kernel
                found["(vector)"] = found.get("(vector)", 0) + 1
        return found

    loops = []  # (depth, body)

    def visit(comp, depth, seen=()):
        if comp in seen:
            return
        for _, _, opcode, rest in comps.get(comp, []):
            if opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
                loops.append((depth + 1, body))
                visit(body, depth + 1, seen + (comp,))
            elif opcode != "fusion":
                for c in counter.callees(rest):
                    visit(c, depth, seen + (comp,))

    def total(found):
        return sum(v for k, v in found.items() if k != "(vector)")

    visit(entry, 0)
    if not loops:
        return {"kernels": 0, "vector": 0, "opcodes": {}, "loops": []}
    counted = [(d, kernels(b)) for d, b in loops]
    deepest = max(d for d, _ in counted)
    best = dict(max((k for d, k in counted if d == deepest), key=total))
    return {"kernels": total(best), "vector": best.pop("(vector)", 0), "opcodes": best,
            "loops": [(d, total(k)) for d, k in counted]}


def tolerance(small: bool) -> list[dict]:
    """CG and BiCGStab to a float32 tolerance (rtol 1e-4, above float32's
    floor): time, iterations and status beside the peer's. The rounds that
    confirm pipelined CG's and BiCGStab's stopping test on the true residual
    (`steps.confirmed_rounds`) all run here, which a fixed step count does
    not show. (Restarted GMRES is left out: to 1e-4 at 2048^2 it takes
    minutes on either side.)"""
    n = 64 if small else 2048
    rtol = 1e-4
    cases = {
        "Poisson": (poisson, "jax.scipy cg", {
            "pcg": lambda b: sx.pcg(poisson, b, rtol=rtol),
            "pcg single_reduction": lambda b: sx.pcg(poisson, b, rtol=rtol,
                                                     single_reduction=True),
            "pcg pipelined": lambda b: sx.pcg(poisson, b, rtol=rtol, method="pipelined"),
            "jax.scipy cg": lambda b: jsl.cg(poisson, b, tol=rtol)}),
        "convection-diffusion": (convection, "jax.scipy bicgstab", {
            "bicgstab": lambda b: sx.bicgstab(convection, b, rtol=rtol),
            "bicgstab one_sync": lambda b: sx.bicgstab(convection, b, rtol=rtol,
                                                       method="one_sync"),
            "jax.scipy bicgstab": lambda b: jsl.bicgstab(convection, b, tol=rtol)}),
    }
    b = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), DTYPE)
    rows = []
    for problem, (A, reference, contenders) in cases.items():
        xs = {name: jax.jit(lambda b, f=f: _x(f(b)))(b) for name, f in contenders.items()}
        seconds = interleaved({k: (lambda b, f=f: _x(f(b))) for k, f in contenders.items()}, b,
                              rounds=5)
        bnorm = float(jnp.linalg.norm(b))
        for name, f in contenders.items():
            ours = not name.startswith("jax.scipy")
            its, status = jax.jit(lambda b, f=f: _counts(f(b)))(b) if ours else (None, None)
            emit(rows, {"problem": f"{problem} {n}^2", "method": name,
                        "iterations": None if its is None else int(its),
                        "status": None if status is None else sx.Status(int(status)).name,
                        "seconds": seconds[name], "ratio": seconds[name] / seconds[reference],
                        "true_residual": float(jnp.linalg.norm(b - A(xs[name]))) / bnorm})
    return rows


def _counts(solution):
    """A solvax `Solution`'s iterations and status (one solve traced)."""
    return solution.iterations, solution.status


def _x(result):
    """The solution of a solvax `Solution` or a jax.scipy `(x, info)`."""
    return result.x if hasattr(result, "x") else result[0]


def _per_step(problem, n, ours, peers, reference, steps, bandwidth):
    b = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), DTYPE)
    contenders = {name: _steps(f, steps) for name, f in ours.items()}
    contenders.update(peers)
    counts = {name: int(jax.jit(f)(b)[1]) for name, f in contenders.items()}
    texts = {name: counter.compiled_text(lambda b, f=f: f(b)[0], b)
             for name, f in contenders.items()}
    if HLO_DIR:
        os.makedirs(HLO_DIR, exist_ok=True)
        for name, text in texts.items():
            tag = re.sub(r"\W+", "_", f"{problem} {name}")
            with open(os.path.join(HLO_DIR, f"{tag}.txt"), "w") as f:
                f.write(text)
    seconds = interleaved({k: (lambda b, f=f: f(b)[0]) for k, f in contenders.items()}, b,
                          rounds=5)
    vector_s = n * n * jnp.dtype(DTYPE).itemsize / (bandwidth * 1e9)
    rows = []
    for name in contenders:
        per = seconds[name] / max(counts[name], 1)
        passes = (gmres_passes(30, "cgs2" in name) if "gmres" in name else PASSES[name])
        emit(rows, {"problem": problem, "method": name, "steps": counts[name],
                    "ms_per_step": 1e3 * per,
                    "ratio": per / (seconds[reference] / max(counts[reference], 1)),
                    "passes": passes, "passes_ms": 1e3 * passes * vector_s,
                    "kernels": step_kernels(texts[name])})
    return rows


def _mg_case(label: str):
    """`(k, b, operator, hierarchy, solve)` of a multigrid case from its label
    (`"2-D 2048^2 W"`): Poisson's coefficients, a random right-hand side, the
    operator of coefficients `k`, its multigrid with the label's cycle, and
    MG-CG to 1e-5 with it."""
    dims, size, cycle = label.split()
    n = int(size.split("^")[0])
    shape = (n,) * (2 if dims == "2-D" else 3)
    k = jnp.ones(shape, DTYPE)
    b = jnp.asarray(np.random.default_rng(0).standard_normal(shape), DTYPE)

    def operator(k):
        return sx.diffusion_operator(k, spacing=1.0 / n)

    def hierarchy(k):
        return sx.multigrid(operator(k), cycle=cycle)

    def solve(k, b):
        return sx.pcg(operator(k), b, precond=hierarchy(k), rtol=1e-5)

    return k, b, operator, hierarchy, solve


def first_call(solve, k, b):
    """`(Solution, seconds)`: `solve`'s first call (trace, compile, run) on
    `k, b`, the arrays already on the device."""
    jax.block_until_ready((k, b))
    t = time.perf_counter()
    sol = jax.block_until_ready(jax.jit(solve)(k, b))
    return sol, time.perf_counter() - t


def fresh_first_call(label: str) -> float:
    """A case's first call in a process of its own (`--first-call`), which
    compiled nothing before it: what a process has compiled moves a first
    call by seconds on a TPU (128^3: 11.4 s after the 2-D cases, 25.6 s as
    the process's first compile)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--first-call", label],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split("first call:")[-1].split()[0])


def multigrid(small: bool, bandwidth: float, only=None, fresh: bool = False) -> list[dict]:
    """The multigrid rows; `only`: texts, a case runs if its label (`"2-D
    2048^2 W"`) contains one of them (`--cases`); `fresh`: each case's first
    call measured again in a fresh process (`fresh_first_call`)."""
    if small:
        cases = [("2-D", 32, "V"), ("3-D", 8, "V")]
    else:
        cases = [("2-D", n, c) for n in (1024, 2048, 4096)
                 for c in (("V", "W", "F") if n == 2048 else ("V",))]
        cases += [("3-D", 128, "V"), ("3-D", 256, "V")]
    rows = []
    for dims, n, cycle in cases:
        label = f"{dims} {n}^{2 if dims == '2-D' else 3} {cycle}"
        if only and not any(t in label for t in only):
            continue
        k, b, operator, hierarchy, solve = _mg_case(label)
        sol, first = first_call(solve, k, b)
        M = jax.jit(hierarchy)(k)
        # every contender takes (k, b, M); the arrays are arguments, never constants
        timing = interleaved({
            "solve": lambda k, b, M, solve=solve: solve(k, b).x,
            "cycle": lambda k, b, M: M(b),
            "cg step": lambda k, b, M, operator=operator: jsl.cg(
                operator(k), b, tol=0.0, atol=0.0, maxiter=20)[0]}, k, b, M, rounds=5)
        step = timing["cg step"] / 20
        levels = len(M.levels)
        model = cycle_passes(levels, dims=k.ndim)
        vector_s = k.size * jnp.dtype(DTYPE).itemsize / (bandwidth * 1e9)
        row = {"case": f"MG-CG {label}", "first_s": first}
        if fresh:
            row["first_fresh_s"] = fresh_first_call(label)
        emit(rows, {**row,
                    "iterations": int(sol.iterations), "status": sx.Status(int(sol.status)).name,
                    "solve_ms": 1e3 * timing["solve"], "cycle_ms": 1e3 * timing["cycle"],
                    "cg_step_ms": 1e3 * step, "cycle_in_cg_steps": timing["cycle"] / step,
                    "levels": levels, "cycle_passes": model,
                    "cycle_passes_ms": 1e3 * model * vector_s})
    return rows


def recycling(small: bool) -> list[dict]:
    n, steps, dt = (24, 3, 1e-2) if small else (96, 12, 1e-2)
    h = 1.0 / n
    x = (jnp.arange(n) + 0.5) * h
    X, Y = jnp.meshgrid(x, x, indexing="ij")

    def operator(t):
        D = sx.diffusion_operator((1.0 + 0.5 * jnp.sin(2 * jnp.pi * (X + Y) + 0.3 * t)
                                   ).astype(DTYPE), spacing=h, shift=1.0 / dt)
        return lambda u: D(u) + 20.0 * (u - jnp.pad(u, ((1, 0), (0, 0)))[:-1]) / h

    u0 = jnp.exp(-100 * ((X - 0.3) ** 2 + (Y - 0.5) ** 2)).astype(DTYPE)

    @jax.jit
    def gmres(t, u, space):
        s = sx.gmres(operator(t), u / dt, x0=u, restart=30, rtol=1e-5)
        return s.x, s.iterations, space

    @jax.jit
    def gcrot(t, u, space):  # space None: cold (a compiled signature of its own)
        s = sx.gcrot(operator(t), u / dt, x0=u, rtol=1e-5, recycle=space)
        return s.x, s.iterations, s.recycle

    rows, times = [], [jnp.asarray(float(i), DTYPE) for i in range(steps)]
    for name, step, hand_on in (("gmres(30)", gmres, False), ("gcrot cold", gcrot, False),
                                ("gcrot recycled", gcrot, True)):
        matvecs, seconds = sequence_matvecs(step, u0, times, hand_on, sx._krylov.gcrot.K)
        emit(rows, {"method": name, "matvecs": matvecs, "seconds": seconds})
    return rows


def mg_cg(k, b, rtol):
    """MG-CG on Poisson of coefficients `k` (its dtype: float32 or float64) to `rtol`."""
    A = sx.diffusion_operator(k, spacing=1.0 / k.shape[0])
    return sx.pcg(A, b, precond=sx.multigrid(A), rtol=rtol, atol=0.0)


def refinement(k, b):
    """Float64 Poisson of coefficients `k` to 1e-10 by iterative refinement
    with float32 MG-CG corrections (issue 51 target 4)."""
    A = sx.diffusion_operator(k, spacing=1.0 / k.shape[0])
    return sx.iterative_refinement(A, b, precond=sx.multigrid(A, dtype=jnp.float32),
                                   rtol=1e-10)


def precision(small: bool, sizes=None, pairs_only: bool = False) -> list[dict]:
    jax.config.update("jax_enable_x64", True)  # float64 from here on (the last part)
    sizes = sizes or ((32, 64) if small else (2048, 4096))
    b64 = {n: np.random.default_rng(0).standard_normal((n, n)) for n in sizes}
    pair = {"float32 MG-CG to its floor": (lambda k, b: mg_cg(k, b, 1e-7), jnp.float32),
            "refinement, float32 MG-CG corrections": (refinement, jnp.float64)}
    alone = {"float64 MG-CG": (lambda k, b: mg_cg(k, b, 1e-10), jnp.float64)}
    # the pair the target compares, interleaved, at every size first; then
    # float64 MG-CG alone (emulated on a TPU: its first call compiles for
    # minutes, so it runs last; not at 4096^2 there)
    groups = [(n, pair) for n in sizes] + [
        (n, alone) for n in sizes if not pairs_only
        and (small or n <= 2048 or jax.default_backend() != "tpu")]
    rows, floors = [], {}
    for n, cases in groups:
        args = {dt: (jnp.ones((n, n), dt), jnp.asarray(b64[n], dt))
                for dt in (jnp.float32, jnp.float64)}
        found = {}
        for name, (fn, dt) in cases.items():
            t = time.perf_counter()
            sol = jax.block_until_ready(jax.jit(fn)(*args[dt]))
            found[name] = (sol, time.perf_counter() - t)
            print(f"  {name} {n}^2: first call {found[name][1]:.1f} s", flush=True)
        # each contender picks its own dtype's arrays from both tuples
        timing = interleaved({name: lambda a32, a64, f=fn, dt=dt: f(*(
            a32 if dt == jnp.float32 else a64)).x for name, (fn, dt) in cases.items()},
            args[jnp.float32], args[jnp.float64], rounds=5)
        floors.setdefault(n, timing.get("float32 MG-CG to its floor"))
        for name, (sol, first) in found.items():
            emit(rows, {"case": f"Poisson {n}^2 {name}", "first_s": first,
                        "status": sx.Status(int(sol.status)).name,
                        "iterations": int(sol.iterations),
                        "true_residual": cell_relative_residual(n, 0.0, sol.x, b64[n]),
                        "seconds": timing[name], "vs_float32": timing[name] / floors[n]})
    return rows


def markdown(meta, out) -> str:
    lines = [f"# solvax speed on {meta['device']} (`benchmarks/accelerator_speed.py`)", "",
             f"- date: {meta['date']}", f"- JAX {meta['jax']}, solvax {meta['solvax']}, float32",
             ""]
    if "triad" in out:
        lines += [f"Triad `1.5 x + z`: {out['triad']['GB/s']:.0f} GB/s.", ""]
    if "krylov" in out:
        lines += ["| problem | method | steps | ms/step | ratio to peer | passes/step | "
                  "passes at triad (ms) | kernels/step (vector) |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['problem']} | {r['method']} | {r['steps']} | {r['ms_per_step']:.4f} | "
                  f"{r['ratio']:.2f} | {r['passes']:.1f} | {r['passes_ms']:.4f} | "
                  f"{r['kernels']['kernels']}"
                  + (f" ({r['kernels']['vector']})" if "vector" in r["kernels"] else "") + " |"
                  for r in out["krylov"]]
        lines.append("")
    if "tolerance" in out:
        lines += ["To rtol 1e-4 (float32), time to the tolerance against the peer:", "",
                  "| problem | method | iterations | status | seconds | ratio to peer | "
                  "true relative residual |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['problem']} | {r['method']} | {r['iterations'] or '-'} | "
                  f"{r['status'] or '-'} | "
                  f"{r['seconds']:.4f} | {r['ratio']:.2f} | {r['true_residual']:.1e} |"
                  for r in out["tolerance"]]
        lines.append("")
    if "multigrid" in out:
        lines += ["| case | first s | iterations | solve ms | cycle ms | CG step ms | "
                  "cycle / CG step | levels | cycle passes | passes at triad (ms) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['first_s']:.2f}"
                  + (f" ({r['first_fresh_s']:.2f} fresh)" if "first_fresh_s" in r else "")
                  + f" | {r['iterations']} | "
                  f"{r['solve_ms']:.3f} | {r['cycle_ms']:.3f} | {r['cg_step_ms']:.4f} | "
                  f"{r['cycle_in_cg_steps']:.1f} | {r['levels']} | {r['cycle_passes']:.1f} | "
                  f"{r['cycle_passes_ms']:.3f} |" for r in out["multigrid"]]
        lines.append("")
    if "precision" in out:
        lines += ["| case | first s | status | iterations | true relative residual (float64) | "
                  "seconds | over float32 |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['first_s']:.2f} | {r['status']} | {r['iterations']} | "
                  f"{r['true_residual']:.1e} | {r['seconds']:.4f} | {r['vs_float32']:.2f} |"
                  for r in out["precision"]]
        lines.append("")
    if "recycling" in out:
        lines += ["| sequence method | matvecs | seconds |", "|---|---|---|"]
        lines += [f"| {r['method']} | {r['matvecs']} | {r['seconds']:.3f} |"
                  for r in out["recycling"]]
        lines.append("")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny sizes (a smoke test)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--only", nargs="+", default=[""], metavar="TEXT")
    p.add_argument("--sizes", nargs="+", type=int, default=None,
                   help="the precision part's grid sizes (default 2048 4096)")
    p.add_argument("--cases", nargs="+", default=None, metavar="TEXT",
                   help="the multigrid part's cases whose label contains one of these")
    p.add_argument("--fresh", action="store_true",
                   help="each multigrid case's first call again in a fresh process")
    p.add_argument("--first-call", default=None, metavar="LABEL",
                   help="only print this multigrid case's first call (what --fresh runs)")
    p.add_argument("--hlo", default=None, help="write each Krylov contender's optimized HLO here")
    p.add_argument("--pairs-only", action="store_true",
                   help="the precision part without all-float64 MG-CG (minutes on a TPU)")
    args = p.parse_args()
    if args.first_call:
        k, b, _, _, solve = _mg_case(args.first_call)
        print(f"first call: {first_call(solve, k, b)[1]:.3f} s")
        return
    global HLO_DIR
    HLO_DIR = args.hlo
    device = jax.devices()[0]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "backend": jax.default_backend(),
            "device": f"{device.platform}: {getattr(device, 'device_kind', '?')}",
            "jax": jax.__version__, "solvax": sx.__version__,
            "stacks_products": sx._core.reduce.stacks_products()}
    wanted = lambda part: any(text in part for text in args.only)  # noqa: E731
    out = {"triad": triad(args.small)}
    bandwidth = out["triad"]["GB/s"]
    print(f"triad: {bandwidth:.0f} GB/s", flush=True)
    for name, part in (("krylov", lambda: krylov(args.small, bandwidth)),
                       ("tolerance", lambda: tolerance(args.small)),
                       ("multigrid", lambda: multigrid(args.small, bandwidth, args.cases,
                                                      args.fresh)),
                       ("recycling", lambda: recycling(args.small)),
                       # last: x64 on
                       ("precision", lambda: precision(args.small, args.sizes, args.pairs_only))):
        if wanted(name):
            out[name] = part()   # its rows printed as they came (`emit`)
            write(args.out, meta, out)  # after every part: a run cut short keeps the rest
    write(args.out, meta, out)
    print(markdown(meta, out))


def write(folder: str, meta: dict, out: dict) -> None:
    """`accelerator_speed.json` and `<backend>_speed.md` in `folder`, with the
    parts measured so far."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "accelerator_speed.json"), "w") as f:
        json.dump({"meta": meta, **out}, f, indent=1)
    with open(os.path.join(folder, f"{meta['backend']}_speed.md"), "w") as f:
        f.write(markdown(meta, out))


if __name__ == "__main__":
    main()
