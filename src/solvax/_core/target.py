"""One place that decides each target's form.

A *form* is a choice that depends on the machine a program runs on and not on
the arithmetic: how a step's products are reduced, whether a loop is a loop,
whether a reduction may come before a loop. Every rule of solvax that makes
such a choice reads its inputs here, and only here:

- `platform()`: `"cpu"`, `"gpu"` or `"tpu"` (JAX's default backend, the
  target of a `jit` without explicit devices);
- `devices()`: how many devices a computation may span (JAX's device count);
- a dtype the rule is given (float64 is emulated on a TPU: `dense.emulated`).

`forced(platform, devices=...)` makes every rule read the given target (and
clears JAX's caches on entry and exit, so nothing traced in the other form is
reused): how the tests trace and run each target's form on this CPU, and how
`jax.export(..., platforms=["cuda"])` on a CPU-only machine yields the GPU's
program:

```python
with target.forced("gpu"):
    exported = jax.export.export(jax.jit(solve), platforms=["cuda"])(b)
```

`RULES` lists every rule with its form per target and why; `table()` renders
them (`docs/targets.md` is that table; a test keeps them equal).

Known limit: the forms are chosen when a function is traced, from the
process's default backend and device count, not from the platform a program
is lowered for (`jax.lax.platform_dependent`) nor from the devices the
computation itself spans; an export for another platform needs `forced`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax

PLATFORMS = ("cpu", "gpu", "tpu")

_FORCED: dict = {"platform": None, "devices": None}


def _normalized(name: str) -> str:
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def platform() -> str:
    """The platform every form is chosen for: the forced one, else JAX's
    default backend (`"cuda"` and `"rocm"` are `"gpu"`)."""
    return _FORCED["platform"] or _normalized(jax.default_backend())


def devices() -> int:
    """The devices a computation may span: the forced count, else JAX's
    device count (of the default backend)."""
    forced_count = _FORCED["devices"]
    return jax.device_count() if forced_count is None else forced_count


def one_device() -> bool:
    return devices() == 1


@contextlib.contextmanager
def forced(platform: str | None = None, *, devices: int | None = None):
    """Within it, every rule reads `platform` (one of `PLATFORMS`) and
    `devices` where given. JAX's trace caches are cleared on entry and exit:
    a function jitted outside would otherwise keep its other form."""
    if platform is not None and _normalized(platform) not in PLATFORMS:
        raise ValueError(f"`platform` must be one of {PLATFORMS}; got {platform!r}.")
    if devices is not None and (not isinstance(devices, int) or devices < 1):
        raise ValueError(f"`devices` must be a positive int; got {devices!r}.")
    before = dict(_FORCED)
    _FORCED.update(platform=None if platform is None else _normalized(platform),
                   devices=devices)
    jax.clear_caches()
    try:
        yield
    finally:
        _FORCED.update(before)
        jax.clear_caches()


# ------------------------------------------------------------- loop forms
#: Krylov steps per convergence test on a GPU (`steps_per_test`):
#: provisional, not yet measured on a GPU.
GPU_STEPS_PER_TEST = 8


def steps_per_test() -> int:
    """How many steps a Krylov loop takes between two convergence tests
    (`_krylov.steps.while_loop`): 1 where a loop's predicate stays on the
    device (CPU, TPU); on a GPU a counted inner loop of `GPU_STEPS_PER_TEST`
    steps (its trip count known to XLA: no predicate copied to the host),
    with the state frozen once the test fails, so that `x`, the history and
    the iterations equal one test per step. The environment variable
    `SOLVAX_STEPS_PER_TEST` (a positive int, read when a solve is traced)
    sets it on every target: how the GPU lane measures k = 1, 4, 8, 16."""
    given = os.environ.get("SOLVAX_STEPS_PER_TEST")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError("SOLVAX_STEPS_PER_TEST must be a positive integer (steps "
                             f"between two convergence tests); got {given!r}.")
        return int(given)
    return GPU_STEPS_PER_TEST if platform() == "gpu" else 1


def loop_unroll(length: int) -> int:
    """A multigrid loop's `unroll` over `length` levels, visits or smoothing
    steps: 1, a loop, on every target. On a GPU a loop whose trip count XLA
    knows runs without copying its predicate to the host, and the unrolled
    form grew exponentially with the levels of a W-cycle."""
    del length
    return 1


def branches_on_device() -> bool:
    """Whether a conditional inside a loop is decided on the device (CPU,
    TPU); on a GPU its index is copied to the host each time it runs, so a
    loop there selects instead (computing what a branch would skip where
    that is cheap: a W-cycle's second visit's residual, one coarse stencil
    application)."""
    return platform() != "gpu"


def fusion_barriers() -> bool:
    """Whether a multigrid cycle puts its intermediate grids behind fusion
    barriers (`fusion.computed`: a conditional with a predicate the
    compiler cannot fold): on the CPU only, where XLA otherwise recomputes a
    stencil's input at every offset it reads. On a GPU a conditional's
    predicate goes to the host; a TPU fuses well without them."""
    return platform() == "cpu"


@dataclasses.dataclass(frozen=True)
class Rule:
    """A form chosen per target: its function, the form on each of
    CPU / GPU / TPU (and one device against a mesh where that differs), and
    why (with the measurement behind it; the function's docstring has more)."""

    name: str
    where: str
    cpu: str
    gpu: str
    tpu: str
    why: str


RULES = (
    Rule("stacks_products", "_core.reduce",
         "mesh: stacked; one device: separate", "separate", "separate",
         "XLA:CPU runs a tuple all-reduce as one rendezvous per array; GPU and TPU "
         "combine a step's all-reduces; on one device a stacked array is materialized "
         "(one-sync BiCGStab 256^2 on one CPU: 0.58 against 1.60 ms a step)"),
    Rule("sums_in_sequence", "_core.reduce", "one device (emulated dtypes only)",
         "one device (emulated dtypes only)", "one device: in sequence",
         "XLA:TPU fused float64 (emulated) reductions into kernels that compiled for "
         "minutes (refinement 4096^2: > 120 s, 27 s in sequence)"),
    Rule("reduces_before_loop", "_core.reduce", "one device: yes; mesh: no",
         "one device: yes; mesh: no", "one device: yes; mesh: no",
         "a reduction before the loop synchronizes nothing on one device: standard CG "
         "tests <r, r> at the close of a step (3 vector kernels a step on a TPU)"),
    Rule("reads_rows_in_use", "_core.reduce", "no", "no", "one device: yes",
         "GMRES(30) one-sync on a TPU v5e at 1024^2: 0.68x jax.scipy per matvec "
         "reading the rows in use, 1.01x reading every row"),
    Rule("combines_by_gemm", "_core.tree", "GEMM", "GEMM", "elementwise sum",
         "a dot made XLA:TPU tile the basis and copy it at every Arnoldi step "
         "(one-sync GMRES(30) 2048^2: 2.92 against 1.67 ms per matvec)"),
    Rule("emulated", "_core.dense", "no", "no", "float64: yes",
         "float64 on a TPU lowers elementwise arithmetic and products only: the "
         "small dense factorizations take portable forms there"),
    Rule("svd_lowers", "_core.dense", "yes", "yes", "not float32 with x64 on",
         "a float32 SVD with x64 enabled aborted XLA:TPU's compiler (JAX 0.10.2, v5e)"),
    Rule("fusion_barriers", "_core.target", "yes", "no", "no",
         "XLA:CPU recomputes a stencil's fused input at every offset (two Jacobi steps "
         "at 1024^2: 13.8 ms against 5.2); a GPU conditional goes to the host"),
    Rule("branches_on_device", "_core.target", "yes", "no: select", "yes",
         "XLA:GPU copies a conditional's index to the host each time it runs"),
    Rule("loop_unroll", "_core.target", "1 (a loop)", "1 (a loop)", "1 (a loop)",
         "a loop with a known trip count runs on the device everywhere; unrolled on a "
         "GPU, a W-cycle's program grew exponentially with its levels"),
    Rule("steps_per_test", "_core.target", "1", f"{GPU_STEPS_PER_TEST} (provisional)", "1",
         "XLA:GPU copies an uncounted while loop's predicate to the host every "
         "iteration; a counted inner loop of k steps tests once per k"),
    Rule("one device (multigrid)", "_grid.multigrid.builder", "devices == 1",
         "devices == 1", "devices == 1",
         "on one device a smoother's steps are a loop and levels need no gather"),
)


def table() -> str:
    """`RULES` as a Markdown table (`docs/targets.md`)."""
    lines = ["| rule | module | CPU | GPU | TPU | why |", "|---|---|---|---|---|---|"]
    lines += [f"| `{r.name}` | `{r.where}` | {r.cpu} | {r.gpu} | {r.tpu} | {r.why} |"
              for r in RULES]
    return "\n".join(lines)
