"""What a TPU taught, pinned on the CPU (`benchmarks/accelerator.py` runs the
same cases on a chip): jaxpr scans of every registered solver, preconditioner
and structured solve for what an accelerator runs differently.

- A floating `dot_general` without precision HIGHEST runs as one bfloat16
  pass on a TPU (gcrot diverged in float32 there): every product states it.
- A TPU emulates float64: 64-bit bitcasts (frexp, ldexp, nextafter, 64-bit
  random bits) and float64 factorizations (LU, eigh, SVD, QR, Cholesky,
  triangular solves) do not lower or compile for minutes. In `_dense.portable()`
  (the form the library takes where `_dense.emulated` says so) no such
  primitive on a 64-bit operand remains.
- A float32 SVD aborts the TPU compiler once x64 is enabled (JAX 0.10.2;
  `jnp.linalg.svd` alone, and `jnp.linalg.pinv` around it), where the
  emulated float64 SVD compiles (for about 40 s) and runs: in
  `_dense.portable()` (x64 is on in these tests) no float32 SVD remains
  (the float32 pseudo-inverse is computed from products); a float64 one
  may.
- A TPU compiled the float64 refinement at 4096^2 for minutes while a
  step's emulated float64 sums were side by side (27 s in sequence): one
  device's and `shard_map`'s sums of an emulated dtype are chained.
- On one chip standard CG closes each step with its reduction, fused with
  the residual's update (`reduce.reduces_before_loop`); on a mesh it stays
  at the next step's top (the pinned counts): both forms, same outcome.
- On one chip GMRES's steps read the basis rows in use only
  (`reduce.reads_rows_in_use`, `lax.switch`es that stay conditionals
  under `vmap`); on a mesh the whole basis: same outcome.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SOLVERS, count_primitives, mesh, patched_rule, rel_err
from jax.sharding import PartitionSpec as P

import solvax as sx
from solvax._core import dense as _dense

SHAPE = (16, 16)
# linalg primitives a TPU cannot run in float64 (or compiles for minutes)
FACTORIZATIONS = {"lu", "eigh", "cholesky", "qr", "geqrf", "geqp3", "householder_product",
                  "triangular_solve", "lu_pivots_to_permutation", "schur", "eig", "hessenberg"}


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            sub = getattr(sub, "jaxpr", sub)
            if hasattr(sub, "eqns"):
                yield sub


def offences(jaxpr) -> list[str]:
    """What in `jaxpr` (nested ones too) an accelerator runs differently."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        dtypes = [jnp.dtype(v.aval.dtype) for v in (*eqn.invars, *eqn.outvars)
                  if hasattr(v.aval, "dtype")
                  and not jnp.issubdtype(v.aval.dtype, jax.dtypes.extended)]
        wide = any(d.itemsize == 8 for d in dtypes)
        floating = any(jnp.issubdtype(d, jnp.inexact) for d in dtypes)
        where = jax._src.source_info_util.summarize(eqn.source_info)
        if name == "dot_general" and floating:
            precision = eqn.params.get("precision")
            stated = (precision if isinstance(precision, tuple) else (precision,))
            if not all(p is not None and str(p).endswith("HIGHEST") for p in stated):
                found.append(f"dot_general without HIGHEST at {where}")
        elif name in ("bitcast_convert_type", "random_bits") and wide:
            found.append(f"64-bit {name} at {where}")
        elif name in ("nextafter", "frexp", "ldexp"):
            found.append(f"{name} at {where}")
        elif name in FACTORIZATIONS and wide and floating and _dense._FORCED[0]:
            found.append(f"float64 {name} at {where}")
        elif name == "svd" and not wide and _dense._FORCED[0]:
            found.append(f"float32 svd at {where}")
        elif name == "custom_jvp_call" and "svd" in str(eqn.params.get("call_jaxpr")):
            found.append(f"jnp.linalg.pinv (an SVD under a custom JVP) at {where}")
        for sub in _subjaxprs(eqn):
            found += offences(sub)
    return found


def scan(fn, *args) -> list[str]:
    return sorted(set(offences(jax.make_jaxpr(fn)(*args).jaxpr)))


@functools.cache
def problem(dtype):
    k = jnp.ones(SHAPE, dtype)
    op = sx.diffusion_operator(k, shape=SHAPE, spacing=1 / 16)
    return op, jnp.ones(SHAPE, dtype), sx.multigrid(op)


@pytest.mark.parametrize("name", list(SOLVERS))
def test_every_solver_states_precision_and_lowers_float64(name):
    """Primal and gradient, float32 and float64, with and without multigrid,
    and in float64 in the portable form too: nothing a TPU runs differently."""
    solve = SOLVERS[name].solve
    for dtype in (jnp.float32, jnp.float64):
        op, b, mg = problem(dtype)
        for precond in (None, mg):
            options = {} if precond is None else {"precond": precond}

            def loss(b, options=options, op=op):
                return jnp.sum(solve(op, b, **options).x ** 2)

            assert scan(jax.grad(loss), b) == [], (jnp.dtype(dtype).name, precond is None)
    with _dense.portable():
        op, b, mg = problem(jnp.float64)
        def loss(b, op=op, mg=mg):
            return jnp.sum(solve(op, b, precond=mg).x ** 2)

        assert scan(jax.grad(loss), b) == []


def test_preconditioners_and_structured_solves_lower_float64():
    rng = np.random.default_rng(0)
    n, m = 12, 3
    blocks = [jnp.asarray(rng.standard_normal((n, m, m))) + 4 * jnp.eye(m) for _ in range(3)]
    bands = [jnp.asarray(rng.standard_normal(n)) for _ in range(3)]
    bands[1] = bands[1] + 4
    rhs = jnp.asarray(rng.standard_normal((n, m)))
    vec = jnp.asarray(rng.standard_normal(n))
    op, b, _ = problem(jnp.float64)
    cases = {
        "tridiagonal": lambda: sx.tridiagonal_solve(*bands, vec),
        "cyclic tridiagonal": lambda: sx.cyclic_tridiagonal_solve(*bands, vec),
        "block tridiagonal": lambda: sx.block_tridiagonal_solve(*blocks, rhs),
        "cyclic block": lambda: sx.cyclic_block_tridiagonal_solve(*blocks, rhs),
        "banded": lambda: sx.banded_solve(jnp.stack(bands), vec, lower_bandwidth=1,
                                          upper_bandwidth=1),
        "block jacobi": lambda: sx.block_jacobi(blocks[1])(rhs.reshape(n * m)),
        "spectrum estimate": lambda: sx.estimate_spectrum(op, b),
        "multigrid lines": lambda: sx.multigrid(op, coarse="lines")(b),
    }
    with _dense.portable():
        for name, case in cases.items():
            found = scan(lambda case=case: jax.tree_util.tree_leaves(case())[0])
            assert found == [], name


def _svd_dtypes(fn, *args) -> set[str]:
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "svd":
                yield jnp.dtype(eqn.invars[0].aval.dtype).name
            for sub in _subjaxprs(eqn):
                yield from walk(sub)
    return set(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_float32_pseudo_inverse_takes_no_svd_where_the_tpu_aborts_on_it():
    """A float32 multigrid set-up (a dense coarse pseudo-inverse) in the TPU's
    form with x64 on takes no SVD at all (products: `_schulz_pinv`); off that
    rule (this CPU's own form) it keeps its float32 SVD. The products' form
    matches NumPy's pseudo-inverse on a nonsingular coarse operator, a
    singular one (pure Neumann: its null space left out) and a random
    matrix; the float64 (emulated) form still takes its SVD in float64."""
    k = jnp.ones(SHAPE, jnp.float32)

    def setup(k):
        return jax.tree_util.tree_leaves(sx.multigrid(sx.diffusion_operator(k, spacing=1 / 16)))

    rng = np.random.default_rng(3)
    rough = jnp.asarray(np.exp(2 * rng.standard_normal((8, 8))))
    cases = [rng.standard_normal((24, 24))] + [
        np.asarray(jax.jacfwd(sx.diffusion_operator(rough, boundary=b))(jnp.zeros((8, 8))))
        .reshape(64, 64) for b in ("dirichlet", "neumann")]
    assert _svd_dtypes(setup, k) == {"float32"} and _dense.svd_lowers(jnp.float32)
    with _dense.portable():
        assert _svd_dtypes(setup, k) == set() and scan(setup, k) == []
        assert not _dense.svd_lowers(jnp.float32) and _dense.svd_lowers(jnp.float64)
        assert _svd_dtypes(setup, k.astype(jnp.float64)) == {"float64"}
        for a in cases:
            x = _dense.pinv(jnp.asarray(a, jnp.float32))
            assert x.dtype == jnp.float32 and rel_err(x, np.linalg.pinv(a)) < 1e-4


def test_a_narrowed_hierarchy_reads_its_coefficients_cast_once():
    """`multigrid(A, dtype=float32)` of a float64 operator casts the
    coefficients into memory (an optimization barrier) before the set-up
    reads them. Without it a TPU fused the float64 harmonic means of
    `diffusion_operator` into each float32 reader, in emulated float64: the
    first call of refinement with float32 MG-CG corrections at 2048^2
    compiled for 127 s there, 16 s with the barrier. No float64 array
    reaches the set-up; the nearest valid input (no `dtype`: the hierarchy
    in the operator's own precision) casts nothing and has no barrier."""
    k = jnp.asarray(np.exp(np.random.default_rng(0).standard_normal(SHAPE)))

    def setup(k, dtype):
        return sx.multigrid(sx.diffusion_operator(k, spacing=1 / 16), dtype=dtype)

    def barriers(dtype):
        eqns = jax.make_jaxpr(functools.partial(setup, dtype=dtype))(k).jaxpr.eqns
        found = [i for i, e in enumerate(eqns) if e.primitive.name == "optimization_barrier"
                 and all(jnp.dtype(v.aval.dtype) == jnp.float32 for v in e.outvars)]
        return eqns, found

    eqns, found = barriers(jnp.float32)
    assert found
    after = eqns[found[0] + 1:]
    wide = [e.primitive.name for e in after for v in e.invars
            if jnp.ndim(v.aval) > 0 and jnp.dtype(v.aval.dtype) == jnp.float64]
    assert wide == []
    leaves = jax.tree_util.tree_leaves(setup(k, jnp.float32))
    assert all(v.dtype == jnp.float32 for v in leaves if jnp.issubdtype(v.dtype, jnp.floating))
    assert barriers(None)[1] == []


def test_power_of_two_scale_is_exact_without_bitcasts():
    """`power_of_two_below` equals frexp's power of two on every normal
    number (subnormals: the smallest normal one), float32 and float64."""
    from solvax._core.reduce import power_of_two_below

    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        info = np.finfo(dtype)
        v = np.exp(rng.uniform(np.log(info.tiny), np.log(info.max), 4000))
        v = np.concatenate([v, [info.tiny, info.max, 1, 2, 0.5, 3, info.tiny / 2]]).astype(dtype)
        got = np.asarray(jax.jit(power_of_two_below)(jnp.asarray(v)))
        want = np.maximum(np.ldexp(np.ones_like(v), np.frexp(v)[1] - 1), info.tiny)
        np.testing.assert_array_equal(got, want)
        assert scan(power_of_two_below, jnp.asarray(v)) == []


def test_power_of_two_scale_stays_small_when_fused():
    """Written out without sharing (as a fusion that recomputes each
    producer for each consumer), it stays small: a first version divided out
    `2^(2^k)` step by step, each step reading the last three times (10^21
    nodes unshared), and `python -m solvax` then compiled the IDR(4)
    adjoint on XLA:CPU for over 20 minutes instead of 6 s."""
    from solvax._core.reduce import power_of_two_below

    for dtype in (jnp.float32, jnp.float64):
        jaxpr = jax.make_jaxpr(power_of_two_below)(jnp.ones((), dtype)).jaxpr
        size = {}
        for eqn in jaxpr.eqns:
            n = 1 + sum(size.get(v, 0) for v in eqn.invars if not hasattr(v, "val"))
            size.update({v: n for v in eqn.outvars})
        assert max(size.values()) < 10_000, max(size.values())


def test_portable_eigh_squares_no_large_number():
    """Emulated float64 has float32's exponent range: the rotation's
    `tau^2` overflowed there and a TPU returned NaN eigenvalues. In float32
    (the same range), with couplings from tiny to large: no infinity arises
    (checked op by op) and `t` is the rotation's."""
    app = jnp.asarray([1.0, 1.0, 3.0, 2.0, 0.0, 1.0], jnp.float32)
    aqq = jnp.asarray([2.0, 2.0, 1.0, 2.0, 0.0, 1e30], jnp.float32)
    apq = jnp.asarray([1e-30, 0.0, -0.5, 1.0, 0.0, 1e-30], jnp.float32)
    with jax.debug_infs(True), jax.disable_jit():
        t = np.asarray(_dense._jacobi_tangent(app, aqq, apq), np.float64)
    tau = (np.float64(aqq) - app) / (2 * np.where(apq == 0, 1, np.float64(apq)))
    want = np.where(apq == 0, 0, np.sign(tau + (tau == 0)) / (abs(tau) + np.hypot(1, tau)))
    np.testing.assert_allclose(t, want, rtol=1e-6, atol=1e-38)
    a = np.diag([1.0, 2.0, 5.0]).astype(np.float32)
    a[0, 1] = a[1, 0] = 1e-30
    a[1, 2] = a[2, 1] = 0.5
    values, vectors = _dense._portable_eigh(jnp.asarray(a))
    assert rel_err(values, np.linalg.eigvalsh(a.astype(np.float64))) < 1e-6
    assert rel_err(a @ np.asarray(vectors), np.asarray(vectors) * np.asarray(values)) < 1e-6


@pytest.mark.parametrize("n", [1, 5, 33])
def test_portable_factorizations_match_numpy(n):
    """The forms a TPU runs in float64, on this CPU, against NumPy."""
    rng = np.random.default_rng(n)
    a = rng.standard_normal((n, n))
    spd = a @ a.T + n * np.eye(n)
    b = rng.standard_normal((n, 2))
    tall = rng.standard_normal((n + 2, n))
    with _dense.portable():
        a_, spd_, b_ = map(jnp.asarray, (a, spd, b))
        lu = _dense.lu_factor(a_)
        assert rel_err(_dense.lu_solve(lu, b_), np.linalg.solve(a, b)) < 1e-10
        assert rel_err(_dense.lu_solve(lu, b_, trans=True), np.linalg.solve(a.T, b)) < 1e-10
        assert rel_err(_dense.inv(jnp.stack([spd_, spd_])), np.linalg.inv([spd, spd])) < 1e-12
        assert rel_err(_dense.cholesky(spd_), np.linalg.cholesky(spd)) < 1e-12
        q, r = _dense.qr(jnp.asarray(tall))
        assert rel_err(q @ r, tall) < 1e-13 and rel_err(q.T @ q, np.eye(n)) < 1e-13
        assert rel_err(jnp.abs(_dense.qr(jnp.asarray(tall), mode="r")),
                       np.abs(np.linalg.qr(tall, mode="r"))) < 1e-12
        values, vectors = _dense.eigh(spd_)
        assert rel_err(values, np.linalg.eigvalsh(spd)) < 1e-13
        assert rel_err(spd @ vectors, vectors * values) < 1e-12
        assert rel_err(_dense.pinv(spd_), np.linalg.pinv(spd)) < 1e-12
        singular = np.diag(np.r_[np.arange(1.0, n), 0.0])  # the nearest case: rank n - 1
        assert rel_err(_dense.pinv(jnp.asarray(singular)), np.linalg.pinv(singular)) < 1e-12


@pytest.mark.parametrize("name", ["gmres", "gcrot", "pcg_s_step", "pcg_recycled", "idrs"])
def test_portable_float64_solves_reach_their_tolerance(name):
    """The float64 forms a TPU runs (portable factorizations, multigrid's
    refined pseudo-inverse) converge as the library's do, on this CPU."""
    with _dense.portable():
        op, b, mg = problem(jnp.float64)
        sol = SOLVERS[name].solve(op, b, precond=mg, rtol=1e-10)
        assert sol.converged, sol.message
        r = b - op(sol.x)
        assert float(jnp.linalg.norm(r) / jnp.linalg.norm(b)) < 1e-9


@contextlib.contextmanager
def _rules(monkeypatch, module, rules):
    """Several backend rules of `module` patched at once (`patched_rule`)."""
    with contextlib.ExitStack() as stack:
        for rule, value in rules:
            stack.enter_context(patched_rule(monkeypatch, module, rule, value))
        yield


def _barriers(fn, *args) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return count_primitives(jaxpr, "optimization_barrier")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_emulated_sums_of_one_step_are_read_in_sequence(dtype, monkeypatch):
    """A TPU compiled the float64 refinement at 4096^2 for over 120 s where
    its `||r||^2` and `||x||^2` were summed side by side, 27 s in sequence
    (`reduce.sums_in_sequence`): where a dtype is emulated (here
    `_dense.portable()`), on one device (the rule patched: these tests have 8)
    or inside `shard_map`, a call's sums are chained by barriers, `multi_dot`'s
    and `project_many`'s alike, with the same values; float32, or `jit` on a
    mesh (whose all-reduces XLA merges only while they are independent), never."""
    from solvax._core import reduce as _reduce

    x = jnp.linspace(-1.0, 2.0, 64, dtype=dtype)
    y = jnp.cos(x)
    pairs = lambda x, y: [(x, x), (y, y), (x, y)]  # noqa: E731
    ip = sx.InnerProduct()
    dots = lambda x, y: ip.multi_dot(pairs(x, y))  # noqa: E731
    projections = lambda x, y: ip.project_many(jnp.stack([x, y]), [x], pairs(x, y))  # noqa: E731
    local = sx.shard_map(lambda x, y: sx.InnerProduct(axis_name="i").multi_dot(pairs(x, y)),
                         mesh=mesh(), in_specs=(P("i"), P("i")), out_specs=P())
    want = np.array([x @ x, y @ y, x @ y])
    chained = dtype == jnp.float64
    one_device = [("stacks_products", False), ("sums_in_sequence", True)]
    with _dense.portable(), _rules(monkeypatch, _reduce, one_device):
        for fn in (dots, lambda x, y: projections(x, y)[1], local):
            assert _barriers(fn, x, y) == (2 if chained else 0)
            np.testing.assert_allclose(fn(x, y), want, rtol=1e-5, atol=1e-5)
    gpu_mesh = [("stacks_products", False), ("sums_in_sequence", False)]
    with _dense.portable(), _rules(monkeypatch, _reduce, gpu_mesh):
        assert _barriers(dots, x, y) == 0   # jit on a mesh: independent all-reduces
        assert _barriers(local, x, y) == (2 if chained else 0)
    assert _barriers(dots, x, y) == _barriers(local, x, y) == 0   # float64 native here
    assert _reduce.sums_in_sequence(1) and not _reduce.sums_in_sequence(8)


def test_refinement_sums_its_float64_norms_in_sequence(monkeypatch):
    """The refinement (float64 residuals, float32 corrections) as a TPU runs
    it on one device: its float64 `[||b||^2, ||r||^2, ||x||^2]` and `[||r||^2,
    ||x||^2]` chained, its float32 inner products not; the same answer."""
    from solvax._core import reduce as _reduce

    n = 32
    A = sx.diffusion_operator(jnp.ones((n, n)), spacing=1.0 / n)
    b = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)))
    solve = lambda b: sx.iterative_refinement(A, b, rtol=1e-10)  # noqa: E731
    plain = solve(b)
    counts = {}
    for chain in (False, True):
        with _dense.portable(), _rules(monkeypatch, _reduce, [("stacks_products", False),
                                                              ("sums_in_sequence", chain)]):
            counts[chain] = _barriers(solve, b)
            chained = solve(b)
    assert counts[True] - counts[False] == 2 + 1   # the set-up's three sums, each step's two
    assert bool(chained.converged) and int(chained.iterations) == int(plain.iterations)
    assert rel_err(chained.x, plain.x) < 1e-12


def _cg_cases():
    """`(name, matvec, b, options)`: CG's outcomes, each path of its loop."""
    rng = np.random.default_rng(1)
    n = 24
    q = rng.standard_normal((n, n))
    spd = q @ q.T + n * np.eye(n)
    b = jnp.asarray(rng.standard_normal(n))
    A = lambda v: spd @ v  # noqa: E731
    return [
        ("converged", A, b, {}),
        ("preconditioned", A, b, {"precond": lambda v: v / np.diag(spd)}),
        ("x0", A, b, {"x0": jnp.ones(n)}),
        ("zero b", A, 0 * b, {}),
        ("indefinite operator", lambda v: (q + q.T) @ v, b, {}),
        ("indefinite preconditioner", A, b, {"precond": lambda v: -v}),
        ("step limit", A, b, {"max_steps": 3}),
        ("no steps", A, b, {"max_steps": 0}),
        ("nonfinite", A, b.at[3].set(jnp.nan), {}),
        ("float32 floor", lambda v: jnp.asarray(spd, jnp.float32) @ v, b.astype(jnp.float32),
         {"rtol": 1e-7}),
        ("complex", lambda v: (spd + 1j * (q - q.T)) @ v, b + 1j * b, {}),
        ("pytree", lambda t: {"a": A(t["a"]), "c": 2.0 * t["c"]},
         {"a": b, "c": jnp.ones(3)}, {}),
    ]


def _cg_forms(one_device: bool, monkeypatch) -> dict:
    """Every CG outcome `test_cg_reducing_before_its_loop_is_the_same_solve`
    compares, computed with `reduces_before_loop` patched to `one_device`.
    Every solve is traced afresh (a new function, traced under the patch), so
    JAX's caches are left alone: clearing them (`patched_rule`) costs the rest
    of a worker's tests their compiled programs."""
    from solvax._core import reduce as _reduce

    found = {}
    monkeypatch.setattr(_reduce, "reduces_before_loop", lambda *a, **k: one_device)
    try:
        for name, A, b, options in _cg_cases():
            methods = ("standard", "single_reduction") + (
                ("pipelined",) if name in _PIPELINED_CASES else ())
            for method in methods:
                solve = jax.jit(lambda b, A=A, o=options, m=method: sx.pcg(
                    A, b, record_history=True, method=m, **o))
                sums = count_primitives(jax.make_jaxpr(solve)(b), "reduce_sum")
                found[name, method] = solve(b), sums
        n = 16
        A = sx.diffusion_operator(jnp.ones((n, n)), spacing=1.0 / n)
        bs = jnp.asarray(np.random.default_rng(2).standard_normal((3, n, n)))
        loss = lambda t: jnp.sum(sx.pcg(lambda v: A(v) + t * v, bs[0], rtol=1e-10).x ** 2)  # noqa: E731
        found["grad"] = jax.grad(loss)(0.5)
        found["vmap"] = jax.vmap(lambda b: sx.pcg(A, b, rtol=1e-10).iterations)(bs)
        calls = []

        def counted(v):
            jax.debug.callback(lambda: calls.append(1))
            return v / A.diagonal()

        sol = jax.jit(lambda b: sx.pcg(A, b, precond=counted, rtol=1e-8))(bs[0])
        jax.effects_barrier()
        found["precond"] = bool(sol.converged), int(sol.iterations), len(calls)
    finally:
        monkeypatch.undo()
    return found


#: pipelined CG's share of the cases (its compiles are the costliest)
_PIPELINED_CASES = ("converged", "preconditioned", "zero b", "step limit", "nonfinite",
                    "float32 floor")


def test_cg_reducing_before_its_loop_is_the_same_solve(monkeypatch):
    """CG as one device runs it (`reduce.reduces_before_loop`: standard CG
    tests `<r, r>` at the close of each step, the first before the loop, and
    applies `M` only to go on; the other recurrences take `||b||^2` before
    the loop) and as a mesh runs it: the same iterations, status, history and
    `x` on every path out of the loop, the same gradient and batch; `M` once
    per step taken on one device (an MG-CG solve one V-cycle fewer: 9-10% of
    float32 MG-CG at 2048^2 and 4096^2 on a chip), once more on a mesh."""
    from solvax._core import reduce as _reduce

    mesh_form, one = _cg_forms(False, monkeypatch), _cg_forms(True, monkeypatch)
    for (name, method), (top, sums) in ((k, v) for k, v in mesh_form.items()
                                        if isinstance(k, tuple)):
        end, end_sums = one[name, method]
        where = (name, method)
        assert end_sums > sums or name == "x0" and method != "standard", where
        assert int(end.iterations) == int(top.iterations), where
        assert int(end.status) == int(top.status), where
        # to rounding at the scale of the start (the two programs may fuse and
        # so round differently; a late history entry is 1e-7 of the first)
        scale = float(np.nanmax(np.asarray(top.history)))
        np.testing.assert_allclose(end.history, top.history, rtol=1e-12, atol=1e-13 * scale,
                                   equal_nan=True, err_msg=str(where))
        for u, v in zip(jax.tree.leaves(end.x), jax.tree.leaves(top.x), strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-13 * float(np.max(np.abs(v))),
                                       err_msg=str(where))
    np.testing.assert_allclose(one["grad"], mesh_form["grad"], rtol=1e-10)
    np.testing.assert_array_equal(one["vmap"], mesh_form["vmap"])
    converged, steps, calls = mesh_form["precond"]
    assert converged and calls == steps + 1
    assert one["precond"] == (True, steps, steps)
    assert _reduce.reduces_before_loop(1) and not _reduce.reduces_before_loop(8)


def _gmres_cases():
    """`(name, solve)`: GMRES (both orthogonalizations) and gcrot on every
    path through `arnoldi.on_rows`."""
    n = 12
    rng = np.random.default_rng(3)
    A = sx.diffusion_operator(jnp.asarray(1 + rng.random((n, n))), spacing=1.0 / n)
    b = jnp.asarray(rng.standard_normal((n, n)))
    jacobi = lambda v: v / A.diagonal()  # noqa: E731

    def conv(v):
        return A(v) + 40.0 * (v - jnp.roll(v, 1, 0))

    def singular(v):
        return conv(v).at[0].set(0.0)

    cgs2 = functools.partial(sx.gmres, orthogonalization="cgs2")
    return [
        ("one_sync", lambda: sx.gmres(conv, b, restart=20, record_history=True)),
        ("one_sync preconditioned", lambda: sx.gmres(conv, b, restart=7, precond=jacobi,
                                                     record_history=True)),
        ("cgs2", lambda: cgs2(conv, b, restart=20, record_history=True)),
        ("cgs2 preconditioned", lambda: cgs2(conv, b, restart=7, precond=jacobi)),
        ("complex", lambda: sx.gmres(conv, b * (1 + 0.5j), restart=9)),
        ("float32", lambda: cgs2(lambda v: conv(v).astype(v.dtype), b.astype(jnp.float32),
                                 restart=10)),
        ("singular", lambda: sx.gmres(singular, b, restart=10)),
        ("gcrot", lambda: sx.gcrot(conv, b, m=10, k=4, precond=jacobi)),
        ("vmap", lambda: jax.vmap(lambda s: sx.gmres(conv, s * b, restart=10, rtol=1e-9))(
            jnp.asarray([1.0, 1e-3, 0.0]))),
    ]


def test_gmres_reading_the_rows_in_use_is_the_same_solve(monkeypatch):
    """GMRES and gcrot as one chip runs them (`reduce.reads_rows_in_use`:
    each step's projections and combinations read the basis rows in use
    only, rounded up to a quarter, one `lax.switch` branch each) and as a
    mesh runs them (every row): the same iterations, status and history,
    `x` to rounding; a batch keeps its conditionals (their index the
    batch's most rows, not a select over every branch)."""
    from solvax._core import reduce as _reduce

    found = {}
    for rows_in_use in (False, True):
        monkeypatch.setattr(_reduce, "reads_rows_in_use", lambda *a, _v=rows_in_use, **k: _v)
        for name, solve in _gmres_cases():   # new closures: traced under this value
            jaxpr = jax.make_jaxpr(solve)()
            found[rows_in_use, name] = jax.jit(solve)(), count_primitives(jaxpr, "cond")
        monkeypatch.undo()
    for name, _ in _gmres_cases():
        (whole, conds), (rows, row_conds) = found[False, name], found[True, name]
        # a batched switch index would have made every branch a select
        assert row_conds > conds, name
        np.testing.assert_array_equal(rows.iterations, whole.iterations, err_msg=name)
        np.testing.assert_array_equal(rows.status, whole.status, err_msg=name)
        if whole.history is not None:
            # rounding: at most ~1e-15 of the residual the cycle started from
            np.testing.assert_allclose(rows.history, whole.history, rtol=1e-8, equal_nan=True,
                                       atol=1e-13 * float(whole.history[0]), err_msg=name)
        tol = 1e-5 if name == "float32" else 1e-12
        np.testing.assert_allclose(rows.x, whole.x, rtol=tol, atol=tol * float(
            jnp.max(jnp.abs(whole.x))), err_msg=name)
    assert int(found[False, "singular"][0].status) != int(sx.Status.CONVERGED)
    assert _reduce.reads_rows_in_use("tpu", 1)
    assert not _reduce.reads_rows_in_use("tpu", 8) and not _reduce.reads_rows_in_use("cpu", 1)
