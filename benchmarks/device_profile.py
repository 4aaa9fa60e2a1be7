"""Where a compiled program's device time goes, kernel by kernel (a profiler trace).

`python benchmarks/device_profile.py [--small] [--out DIR] [--only TEXT ...]`

Each case is jitted, run once to compile, then run `repeat` times inside
`jax.profiler.trace`; the trace's device events (TPU/GPU planes, or the CPU
threads' HLO ops) are summed by HLO instruction name and divided by
`repeat`: microseconds per call, the number of launches per call, and the
share of the call. A loop's or conditional's own event spans the kernels it
launched and an async copy's `copy-done` its wait: both are listed but left
out of the sum and the launches (an async slice's `slice-done` is counted).
A call's wall time (untraced, the median of `repeat` calls, printed beside
the sum) minus that sum is time between kernels.

The optimized HLO of each case whose name contains one of the
comma-separated texts in the environment variable `PROFILE_HLO` is written
to `DIR/<case>.hlo.txt`, so a fusion's name can be read back into what it
computes (its operands' memory space included: `S(1)` is on-chip).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import jax.scipy.sparse.linalg as jsl
import numpy as np
from accelerator_speed import DTYPE, FAR, convection, mg_cg, refinement
from jax.profiler import ProfileData
from problems import median_time, poisson

import solvax as sx

#: events that span other kernels or wait for a transfer
CONTROL = re.compile(r"%?(while|cond|conditional|call|copy-done)(\.|\s|$)")
HLO = [t for t in os.environ.get("PROFILE_HLO", "").split(",") if t]


def _events(path: str):
    """`(name, duration_ns)` of every device kernel in the trace file."""
    data = ProfileData.from_file(path)
    device = [p for p in data.planes if "/device:" in p.name]
    for plane in device or [p for p in data.planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if device and "XLA Ops" not in line.name:
                continue
            for event in line.events:
                stats = dict(event.stats)
                if device or "hlo_op" in stats:
                    yield stats.get("hlo_op", event.name).split(" = ")[0], event.duration_ns


def _scopes(text: str) -> dict:
    """Each instruction of optimized HLO `text` -> the innermost `solvax.*`
    named scope in its metadata's `op_name` (outermost first: `"solvax.refinement
    > solvax.pcg.matvec"`), or `"(no solvax scope)"`."""
    found = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", text, re.M):
        scopes = re.findall(r"solvax\.[\w.]+", m.group(2))
        found[m.group(1)] = " > ".join(dict.fromkeys(scopes)) or "(no solvax scope)"
    return found


def profile(name: str, fn, args: tuple, repeat: int, out: str, top: int = 25) -> None:
    compiled = jax.jit(fn).lower(*args).compile()
    scopes = _scopes(compiled.as_text())
    if any(text in name for text in HLO):
        with open(os.path.join(out, f"{name}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
    wall = median_time(compiled, *args, repeats=repeat)
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        for _ in range(repeat):
            jax.block_until_ready(compiled(*args))
    total, count = collections.Counter(), collections.Counter()
    for path in glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True):
        for op, ns in _events(path):
            total[op] += ns / 1e3 / repeat
            count[op] += 1 / repeat
    # a loop or conditional's own event spans the kernels it launched
    whole = sum(us for op, us in total.items() if not CONTROL.match(op))
    launches = sum(c for op, c in count.items() if not CONTROL.match(op))
    print(f"\n## {name}: {whole:.1f} us of device kernels per call, {launches:.0f} launches, "
          f"{1e6 * wall:.1f} us wall (untraced, median)", flush=True)
    for op, us in total.most_common(top):
        print(f"  {us:10.2f} us  {count[op]:7.1f} x  {100 * us / max(whole, 1e-9):5.1f}%  {op}")
    by_scope = collections.Counter()
    for op, us in total.items():
        if not CONTROL.match(op):
            by_scope[scopes.get(op.lstrip("%"), "(not in the HLO)")] += us
    print("  by named scope:")
    for scope, us in by_scope.most_common():
        print(f"  {us:10.2f} us  {100 * us / max(whole, 1e-9):5.1f}%  {scope}")


def cases(small: bool):
    """`(name, fn, args, repeat)` (`args` a tuple, or a callable that makes it
    where that costs: a hierarchy built only for a case that runs): MG's
    V-cycle (Poisson, traced coefficients),
    CG's three steps and jax.scipy's (100 steps of Poisson), BiCGStab's two,
    gmres(30) and jax.scipy's (120 matvecs of upwind convection-diffusion)."""
    rng = np.random.default_rng(0)
    for n in (32,) if small else (1024, 4096):
        k = jnp.ones((n, n), DTYPE)
        b = jnp.asarray(rng.standard_normal((n, n)), DTYPE)

        def hierarchy(k=k, b=b, n=n):
            M = jax.jit(lambda k: sx.multigrid(sx.diffusion_operator(k, spacing=1.0 / n)))(k)
            return k, b, M

        yield f"vcycle_{n}", lambda k, b, M: M(b), hierarchy, 20 if n <= 2048 else 5
    for n in (32,) if small else (2048, 4096):
        b = jnp.asarray(rng.standard_normal((n, n)), DTYPE)
        yield f"cg_jax.scipy_{n}", lambda b: jsl.cg(poisson, b, tol=0.0, atol=0.0,
                                                     maxiter=100)[0], (b,), 3
        for m in ("standard", "single_reduction", "pipelined"):
            yield (f"pcg_{m}_{n}", lambda b, m=m: sx.pcg(poisson, b, rtol=FAR, max_steps=100,
                                                        method=m).x, (b,), 3)
    n = 32 if small else 2048
    b = jnp.asarray(rng.standard_normal((n, n)), DTYPE)
    for m in ("standard", "one_sync"):
        yield (f"bicgstab_{m}_{n}", lambda b, m=m: sx.bicgstab(convection, b, rtol=FAR,
                                                              max_steps=100, method=m).x, (b,), 3)
    yield f"bicgstab_jax.scipy_{n}", lambda b: jsl.bicgstab(convection, b, tol=0.0, atol=0.0,
                                                            maxiter=100)[0], (b,), 3
    yield f"gmres_{n}", lambda b: sx.gmres(convection, b, rtol=FAR, restart=30,
                                           max_restarts=4).x, (b,), 3
    yield f"gmres_jax.scipy_{n}", lambda b: jsl.gmres(convection, b, tol=0.0, atol=0.0, restart=30,
                                                      maxiter=4, solve_method="batched")[0], (b,), 3
    yield from precision_cases(small)


def precision_cases(small: bool):
    """Float64 from float32 work (issue 51 target 4), last: x64 goes on when
    the first of them is made. Float32 MG-CG to its floor (rtol 1e-7) and the
    refinement with float32 MG-CG corrections, set-up included, Poisson
    (`accelerator_speed.mg_cg`, `refinement`)."""
    for n in (32,) if small else (2048, 4096):
        def made(dtype, n=n):
            jax.config.update("jax_enable_x64", True)
            b = np.random.default_rng(0).standard_normal((n, n))
            return jnp.ones((n, n), dtype), jnp.asarray(b, dtype)

        yield (f"precision_float32_floor_{n}", lambda k, b: mg_cg(k, b, 1e-7).x,
               lambda made=made: made(DTYPE), 3)
        yield (f"precision_refinement_{n}", lambda k, b: refinement(k, b).x,
               lambda made=made: made(jnp.float64), 3)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default=tempfile.mkdtemp())
    p.add_argument("--only", nargs="+", default=[""], metavar="TEXT")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(jax.devices()[0], jax.__version__, flush=True)
    for name, fn, fargs, repeat in cases(args.small):
        if any(text in name for text in args.only):
            profile(name, fn, fargs() if callable(fargs) else fargs, repeat, args.out)


if __name__ == "__main__":
    main()
