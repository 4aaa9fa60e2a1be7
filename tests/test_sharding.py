"""Sharding preservation and the collective counts of the seed's table, pinned.

Counts are read from the optimized HLO by `sx.count_collectives` on an
emulated CPU mesh. The primal is measured returning `x` (what the adjoint
differentiates); `converged`/`residual_norm` cost one more reduction when used.
The adjoint is `jax.grad` of the nonlinear loss `sum(x**2)` with every sharded
operand a runtime argument (the seed's two measurement notes).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DISTINCT, REPRESENTATIVE, mesh, patched_rule, put, tree_rel_err
from helpers import SOLVERS as REGISTRY
from matrix import FULL, levels, sample

import solvax as sx


def diag_operator(d):
    return lambda x: jax.tree_util.tree_map(jnp.multiply, d, x)


def loss(fn):
    def f(*args):
        out = fn(*args)
        return sum(jnp.sum(jnp.abs(leaf) ** 2) for leaf in jax.tree_util.tree_leaves(out))

    return f


def jacobi_of(d):
    return sx.jacobi(d)


def chebyshev_of(d):
    return sx.chebyshev(diag_operator(d), 2.0, 3.0, degree=3)


def _of(solver, **options):
    return lambda d, b: solver.solve(diag_operator(d), b, **options).x


# Every registered solver (tests/helpers.py), and preconditioned variants of
# the three kinds of step (preconditioners add no collective).
SOLVERS = {name: _of(solver) for name, solver in REGISTRY.items()}
EXPECTED = {name: solver.counts for name, solver in REGISTRY.items()}
PRECONDITIONED = {
    "pcg_jacobi": ("pcg", lambda d: dict(precond=jacobi_of(d))),
    "pcg_chebyshev": ("pcg", lambda d: dict(precond=chebyshev_of(d))),
    "pipelined_jacobi": ("pcg_pipelined", lambda d: dict(precond=jacobi_of(d))),
    "gmres_chebyshev": ("gmres", lambda d: dict(precond=chebyshev_of(d))),
    "bicgstab_one_sync_jacobi": ("bicgstab_one_sync", lambda d: dict(precond=jacobi_of(d))),
    "idrs_jacobi": ("idrs", lambda d: dict(precond=jacobi_of(d))),
    "minres_jacobi": ("minres", lambda d: dict(precond=jacobi_of(d))),
    "s_step_jacobi": ("pcg_s_step", lambda d: dict(precond=jacobi_of(d))),
    # the default s = 4, s = 8, and given spectral bounds (no Ritz values)
    "s_step_4": ("pcg_s_step", lambda d: dict(s=4)),
    "s_step_8_newton": ("pcg_s_step", lambda d: dict(s=8, basis="newton")),
    "s_step_4_spectrum": ("pcg_s_step", lambda d: dict(s=4, spectrum=(2.0, 3.0))),
}
for _name, (_base, _options) in PRECONDITIONED.items():
    SOLVERS[_name] = (lambda d, b, s=REGISTRY[_base], o=_options:
                      s.solve(diag_operator(d), b, **o(d)).x)
    EXPECTED[_name] = REGISTRY[_base].counts
EXPECTED["tridiagonal"] = (0, 0, 0)
# Variants measured in every leaf layout.
LAYOUT_SOLVERS = DISTINCT


def tridiagonal(lower, diag, upper, rhs):
    return sx.tridiagonal_solve(lower, diag, upper, rhs)


def krylov_args(m, n=512, spec=("i",)):
    rng = np.random.default_rng(0)
    d = put(jnp.asarray(2.0 + rng.random(n)), m, *spec)
    b = put(jnp.asarray(rng.standard_normal(n)), m, *spec)
    return d, b


def tridiagonal_args(m, n=24, batch=32):
    rng = np.random.default_rng(1)
    lower, upper, rhs = (put(jnp.asarray(rng.standard_normal((n, batch))), m, None, "i")
                         for _ in range(3))
    diag = put(jnp.asarray(4.0 + rng.random((n, batch))), m, None, "i")
    return lower, diag, upper, rhs


def measure(name, ndev):
    m = mesh(ndev)
    if name == "tridiagonal":
        fn, args, argnums = tridiagonal, tridiagonal_args(m), (0, 1, 2, 3)
    else:
        fn, args, argnums = SOLVERS[name], krylov_args(m), (0, 1)
    primal = sx.count_collectives(fn, *args)
    adjoint = sx.count_collectives(jax.grad(loss(fn), argnums=argnums), *args)
    return primal, adjoint


def counts(name, ndev):
    """`measure`'s reports, cached per product pattern (`stacks_products`): a
    test that patches the rule computed them once under its patch and left
    them for the others (on JAX 0.4.38 the pytree test then compared against
    separate sums)."""
    return _counts(name, ndev, sx._core.reduce.stacks_products())


@functools.cache
def _counts(name, ndev, stacked):
    return measure(name, ndev)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_seed_table_counts(name):
    primal, adjoint = counts(name, 8)
    total, adjoint_total, per_iteration = EXPECTED[name]
    assert primal.total == total, str(primal)
    assert primal.per_iteration == per_iteration, str(primal)
    # gcrot hands its space to the transposed solve, which refreshes it for A^T
    # (Cholesky QR twice: two reductions); deflated CG too (the forward
    # solve's space update, dropped from a primal that returns only x, and the
    # transposed solve's A-orthonormalization); every other adjoint is the
    # primal again
    refresh = 2 if (REGISTRY.get(name, REGISTRY["pcg"]).method == "gcrot"
                    or name == "pcg_recycled") else 0
    assert adjoint.total == adjoint_total == 2 * primal.total + refresh, str(adjoint)
    assert set(primal.by_kind) <= {"all-reduce"} and set(adjoint.by_kind) <= {"all-reduce"}


def test_single_reduction_is_one_all_reduce_per_iteration_on_every_jax():
    """The seed says 0.4-era XLA does not fuse the rewrite; ours stacks the
    products before the sum, so it is one all-reduce per step by construction."""
    primal, adjoint = counts("pcg_single_reduction", 8)
    assert primal.per_iteration == 1 and primal.count("all-reduce") == 2  # and the scale's
    assert adjoint.per_iteration == 1


@pytest.mark.parametrize("name,per_step", [("gmres", 1), ("linear_solve_gmres", 1),
                                           ("gmres_cgs2", 2), ("gmres_chebyshev", 1),
                                           ("minres", 1)])
def test_gmres_reductions_per_arnoldi_step(name, per_step):
    """One reduction per Arnoldi (MINRES: Lanczos) step in the inner loop, one
    per restart (MINRES: per true-residual check) in the outer."""
    primal, _ = counts(name, 8)
    arnoldi = [loop for loop in primal.loops if loop.depth == 1]
    restart = [loop for loop in primal.loops if loop.depth == 0]
    assert [loop.collectives for loop in arnoldi] == [per_step]
    assert [loop.collectives for loop in restart] == [1]


@pytest.mark.parametrize("name", list(PRECONDITIONED))
def test_preconditioners_add_no_collective(name):
    base = PRECONDITIONED[name][0]
    primal, adjoint = counts(name, 8)
    ref_primal, ref_adjoint = counts(base, 8)
    assert (primal.total, primal.per_iteration, adjoint.total) == (
        ref_primal.total, ref_primal.per_iteration, ref_adjoint.total)


def test_diagnostics_cost_one_reduction():
    m = mesh(8)
    d, b = krylov_args(m)
    full = sx.count_collectives(lambda d, b: sx.pcg(diag_operator(d), b), d, b)
    assert full.total == 4 and full.setup == 2 and full.per_iteration == 2
    full = sx.count_collectives(
        lambda d, b: sx.pcg(diag_operator(d), b, single_reduction=True), d, b)
    assert full.total == 3 and full.per_iteration == 1


# The counts pinned on 8 devices hold on 2 and 4 (the other tests pin them on
# 8 only): one variant per method module, each on one of the smaller meshes
# by default; every variant on both with SOLVAX_TEST_MATRIX=full.
@pytest.mark.parametrize("name, ndev", sample(
    "device_count", strength=1, name=["tridiagonal", *levels(LAYOUT_SOLVERS, REPRESENTATIVE)],
    ndev=[2, 4]))
def test_counts_independent_of_device_count(name, ndev):
    reference = counts(name, 8)
    primal, adjoint = counts(name, ndev)
    assert (primal.total, primal.per_iteration, adjoint.total) == (
        reference[0].total, reference[0].per_iteration, reference[1].total)


# ------------------------------------------------- leaf shardings and pytrees
LAYOUTS = {
    "1d_P(i)": [((512,), ("i",))],
    "2d_P(None,i)": [((6, 512), (None, "i"))],
    "2d_P(i,None)": [((512, 6), ("i", None))],
    "dict_mixed": [((512,), ("i",)), ((6, 512), (None, "i")), ((512, 6), ("i", None))],
}


def layout_args(m, layout, scale=1):
    rng = np.random.default_rng(2)
    d, b = {}, {}
    for k, (shape, spec) in enumerate(LAYOUTS[layout]):
        shape = tuple(s * scale if s == 512 else s for s in shape)
        d[f"leaf{k}"] = put(jnp.asarray(2.0 + rng.random(shape)), m, *spec)
        b[f"leaf{k}"] = put(jnp.asarray(rng.standard_normal(shape)), m, *spec)
    return d, b


def same_sharding(out, ref):
    for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert o.sharding.is_equivalent_to(r.sharding, r.ndim), (o.sharding, r.sharding)


# Every variant in one layout and every layout for several variants: one
# variant per method module in the mixed pytree (it holds all three leaf
# layouts), the others spread over the single layouts (every variant in every
# layout with SOLVAX_TEST_MATRIX=full).
def _layout_cases():
    if FULL:
        return sample("layouts", name=LAYOUT_SOLVERS, layout=list(LAYOUTS))
    single = [layout for layout in LAYOUTS if layout != "dict_mixed"]
    others = [name for name in LAYOUT_SOLVERS if name not in REPRESENTATIVE]
    cases = [(name, "dict_mixed") for name in LAYOUT_SOLVERS if name in REPRESENTATIVE]
    cases += [(name, single[k % len(single)]) for k, name in enumerate(others)]
    return [pytest.param(name, layout, id=f"{name}-{layout}") for name, layout in cases]


LAYOUT_CASES = _layout_cases()


@pytest.mark.parametrize("name, layout", LAYOUT_CASES)
def test_no_gather_and_sharding_kept(name, layout):
    m = mesh(8)
    fn = SOLVERS[name]
    d, b = layout_args(m, layout)
    grad = jax.grad(loss(fn), argnums=(0, 1))
    for f in (fn, grad):
        report = sx.count_collectives(f, d, b)
        assert report.count("all-gather") == 0 and report.count("all-to-all") == 0, str(report)
    x = jax.jit(fn)(d, b)
    gd, gb = jax.jit(grad)(d, b)
    same_sharding(x, b)
    same_sharding(gd, d)
    same_sharding(gb, b)
    # the values, from the diagonal operator's exact solution x = b / d
    # (d loss / d b = 2 x / d, d loss / d d = -2 x^2 / d), to the default rtol
    # (1e-8) times the condition (1.5) of the solve and its transposed solve
    exact = jax.tree_util.tree_map(lambda d, b: np.asarray(b) / np.asarray(d), d, b)
    assert tree_rel_err(x, exact) < 1e-7
    assert tree_rel_err(gb, jax.tree_util.tree_map(lambda x, d: 2 * x / np.asarray(d),
                                                   exact, d)) < 1e-7
    assert tree_rel_err(gd, jax.tree_util.tree_map(lambda x, d: -2 * x**2 / np.asarray(d),
                                                   exact, d)) < 1e-7
    # bytes per iteration do not grow with the problem
    big = sx.count_collectives(fn, *layout_args(m, layout, scale=4))
    small = sx.count_collectives(fn, d, b)
    assert big.bytes_per_iteration == small.bytes_per_iteration


def test_tridiagonal_batch_sharded_keeps_sharding_and_matches():
    m = mesh(8)
    args = tridiagonal_args(m)
    x = jax.jit(tridiagonal)(*args)
    grads = jax.jit(jax.grad(loss(tridiagonal), argnums=(0, 1, 2, 3)))(*args)
    same_sharding(x, args[3])
    same_sharding(grads, args)
    local = [jax.device_put(np.asarray(a), jax.devices()[0]) for a in args]
    assert tree_rel_err(x, tridiagonal(*local)) < 1e-12


def test_seed_quickstart_runs_as_written():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    def matvec(x):
        return 3.0 * x - 0.5 * jnp.roll(x, 1) - 0.5 * jnp.roll(x, -1)

    b = jnp.ones(64)
    mesh = Mesh(np.array(jax.devices()), axis_names=("i",))
    b = jax.device_put(b, NamedSharding(mesh, P("i")))
    solution = jax.jit(lambda rhs: sx.pcg(matvec, rhs, single_reduction=True))(b)
    assert bool(solution.converged)
    assert solution.x.sharding.is_equivalent_to(b.sharding, 1)


# Version gate, measured: a multi-leaf pytree whose leaves are sharded
# differently. Each leaf's k products are one stacked reduction by
# construction, but the global sum of the per-leaf partials is an all-reduce
# per leaf under GSPMD. XLA's all-reduce combiner merges them into one (tuple)
# all-reduce per step from jax 0.7 on (`MERGES_ALL_REDUCES`); before (0.4.38,
# 0.5.3, 0.6.2 measured) a step costs one all-reduce per leaf. `axis_name=`
# inside `shard_map` is one psum per step on every version.
LEAVES = 2


def test_merges_all_reduces_flag_matches_the_compiler():
    """The reduction layer issues GMRES projections as separate GEMVs only where
    XLA merges their all-reduces; check the flag against the compiler in use."""
    m = mesh(8)
    basis = put(jnp.ones((4, 64)), m, None, "i")
    u = put(jnp.ones(64), m, "i")

    def two_projections(basis, u):
        def step(_, u):
            a = jax.lax.dot_general(basis, u, (((1,), (0,)), ((), ())))
            b = jax.lax.dot_general(basis, 2 * u, (((1,), (0,)), ((), ())))
            return u - (a + b) @ basis
        return jax.lax.fori_loop(0, 3, step, u)

    report = sx.count_collectives(two_projections, basis, u)
    assert report.per_iteration == (1 if sx._core.reduce.MERGES_ALL_REDUCES else 2), str(report)


# One variant per product pattern of a step: two reductions, one of three
# products, one with a fourth vector stacked in, GMRES's projections, BiCGStab's
# two of three and five, one-sync BiCGStab, IDR(s)'s block.
TUPLE_CASES = ["pcg", "pcg_single_reduction", "pcg_pipelined", "gmres", "gmres_cgs2",
               "bicgstab", "bicgstab_one_sync", "idrs"]


@pytest.mark.parametrize("name", TUPLE_CASES)
def test_separate_products_keep_the_synchronizations_where_tuples_are_one(name, monkeypatch):
    """Where the rule gives separate sums on a mesh (a GPU or TPU, JAX >= 0.7),
    XLA's combiner makes each reduction one tuple all-reduce, one collective
    there: the instructions per step equal the pinned synchronizations, while
    XLA:CPU would run one rendezvous per array (which is why it stacks). On
    JAX < 0.7 (no combiner) the rule keeps stacking on every mesh. (The
    stacked counts are taken before the rule is patched to separate sums.)"""
    stacked = counts(name, 8)[0]
    with patched_rule(monkeypatch, sx._core.reduce, "stacks_products", False):
        report = sx.count_collectives(SOLVERS[name], *krylov_args(mesh(8)))
    if not sx._core.reduce.MERGES_ALL_REDUCES:  # why the rule stacks there
        assert report.per_iteration >= stacked.per_iteration, str(report)
        return
    assert report.total == stacked.total, str(report)
    assert report.per_iteration == stacked.per_iteration == EXPECTED[name][2], str(report)
    on_tpu = report.step_count("all-reduce", backend="tpu")
    assert on_tpu == stacked.step_count("all-reduce", backend="tpu"), str(report)
    assert report.step_count("all-reduce") >= on_tpu


def test_the_product_rule_by_target():
    """Separate sums on one device and on a GPU/TPU mesh where the combiner
    merges them; stacked on an XLA:CPU mesh and on any mesh without it."""
    rule, merges = sx._core.reduce.stacks_products, sx._core.reduce.MERGES_ALL_REDUCES
    assert not rule("cpu", 1) and not rule("tpu", 1) and not rule("gpu", 1)
    assert rule("cpu", 8)
    assert rule("tpu", 4) == rule("gpu", 8) == (not merges)
    assert rule() == (jax.device_count() > 1)  # these tests: 8 emulated CPU devices


@pytest.mark.parametrize("name", LAYOUT_SOLVERS)
def test_pytree_counts_version_gate(name):
    m = mesh(8)
    d, b = layout_args(m, "dict_mixed")
    d = {k: d[k] for k in ("leaf0", "leaf1")}
    b = {k: b[k] for k in ("leaf0", "leaf1")}
    report = sx.count_collectives(SOLVERS[name], d, b)
    single_leaf = counts(name, 8)[0]
    factor = 1 if sx._core.reduce.MERGES_ALL_REDUCES else LEAVES
    assert report.total == factor * single_leaf.total, str(report)
    assert report.per_iteration == factor * single_leaf.per_iteration
    assert report.count("all-gather") == 0


# ------------------------------------------------------ shard_map (axis_name)
@pytest.mark.parametrize("name", DISTINCT)
def test_shard_map_mode_has_the_same_counts(name):
    from jax.sharding import PartitionSpec as P

    m = mesh(8)
    d, b = krylov_args(m)
    solver = REGISTRY[name]

    def solve(d, b, **options):
        return solver.solve(diag_operator(d), b, **options).x

    f = sx.shard_map(lambda d, b: solve(d, b, axis_name="i"), mesh=m,
                     in_specs=(P("i"), P("i")), out_specs=P("i"))
    primal = sx.count_collectives(f, d, b)
    # grad(jit(shard_map)): the nesting that once failed inside JAX ("mul
    # requires varying manual axes to match"), for every variant
    adjoint = sx.count_collectives(jax.grad(loss(jax.jit(f)), argnums=(0, 1)), d, b)
    total, adjoint_total, per_iteration = EXPECTED[name]
    assert (primal.total, primal.per_iteration, adjoint.total) == (
        total, per_iteration, adjoint_total), str(primal)
    assert set(primal.by_kind) == {"all-reduce"}
    # the exact solution b / d, to the default rtol (1e-8) times the condition (1.5)
    assert tree_rel_err(jax.jit(f)(d, b), np.asarray(b) / np.asarray(d)) < 1e-7


# ------------------------------------------- tridiagonal along the sharded axis
@pytest.mark.parametrize("ndev", [2, 4, 8])
@pytest.mark.parametrize("batch", [(), (16,)])
def test_partitioned_tridiagonal_counts(ndev, batch):
    """One all-gather per solve (the reduced interface system), two for the
    adjoint, independent of n, P and the batch; bytes independent of n."""
    m = mesh(ndev)
    rng = np.random.default_rng(3)

    def args(n):
        lower, upper, rhs = (put(jnp.asarray(rng.standard_normal((n, *batch))), m, "i")
                             for _ in range(3))
        diag = put(jnp.asarray(4.0 + rng.random((n, *batch))), m, "i")
        return lower, diag, upper, rhs

    def solve(*a):
        return sx.partitioned_tridiagonal_solve(*a, axis_name="i", mesh=m)

    small, big = args(ndev * 8), args(ndev * 64)
    primal = sx.count_collectives(solve, *small)
    adjoint = sx.count_collectives(jax.grad(loss(solve), argnums=(0, 1, 2, 3)), *small)
    assert primal.total == 1 and primal.by_kind == {"all-gather": 1}, str(primal)
    assert adjoint.total == 2 and adjoint.by_kind == {"all-gather": 2}, str(adjoint)
    assert sx.count_collectives(solve, *big).bytes_by_kind == primal.bytes_by_kind


def test_cyclic_tridiagonal_batch_sharded_is_collective_free():
    m = mesh(8)
    lower, diag, upper, rhs = tridiagonal_args(m)

    def cyclic(*a):
        return sx.cyclic_tridiagonal_solve(*a)

    assert sx.count_collectives(cyclic, lower, diag, upper, rhs).total == 0
    grad = jax.grad(loss(cyclic), argnums=(0, 1, 2, 3))
    assert sx.count_collectives(grad, lower, diag, upper, rhs).total == 0
    same_sharding(jax.jit(cyclic)(lower, diag, upper, rhs), rhs)


# ------------------------------------------------------ block tridiagonal
def test_block_tridiagonal_sharded_batch_is_collective_free():
    """A batch of systems sharded over 8 devices: no collective, forward or
    under grad, through `shard_batch` on every JAX, and through plain `vmap`
    where the partitioner keeps the batch sharding through the pivot blocks'
    LU (LAPACK calls on the CPU): measured on jax 0.10.2; jax 0.4.38 gathers
    the batch there (11 all-gathers), so on it use `shard_batch`."""
    from test_block_tridiagonal import blocks

    m8 = mesh(8)
    batch = [blocks(6, 3, seed=s) for s in range(16)]
    L, D, U = (put(jnp.stack([b[k] for b in batch]), m8, "i") for k in range(3))
    R = put(jnp.asarray(np.random.default_rng(6).standard_normal((16, 6, 3))), m8, "i")
    vmapped = jax.vmap(sx.block_tridiagonal_solve)
    per_device = sx.shard_batch(vmapped, mesh=m8, input_rank=[4, 4, 4, 3], output_rank=3)
    for solve, free in ((per_device, True), (vmapped, jax.__version__ != "0.4.38")):
        loss = lambda *a, solve=solve: jnp.sum(solve(*a) ** 2)  # noqa: E731
        counts = (sx.count_collectives(solve, L, D, U, R).total,
                  sx.count_collectives(jax.grad(loss, argnums=(0, 1, 2, 3)), L, D, U, R).total)
        assert (counts == (0, 0)) == free, counts
    x = jax.jit(per_device)(L, D, U, R)
    assert x.sharding.spec == jax.sharding.PartitionSpec("i")
    assert tree_rel_err(x, vmapped(L, D, U, R)) < 1e-14


@pytest.mark.parametrize("ndev", [2, 4, 8])
def test_partitioned_block_tridiagonal_counts(ndev):
    """One all-gather per solve, two for the gradient, for P = 2, 4, 8
    (accuracy: tests/test_block_tridiagonal.py)."""
    from test_block_tridiagonal import blocks

    m = mesh(ndev)
    args = [put(jnp.asarray(a), m, "i") for a in blocks(4 * ndev, 2, seed=ndev)]
    args.append(put(jnp.ones((4 * ndev, 2)), m, "i"))

    def solve(*a):
        return sx.partitioned_block_tridiagonal_solve(*a, axis_name="i", mesh=m)

    assert sx.count_collectives(solve, *args).by_kind == {"all-gather": 1}
    grad = jax.grad(lambda *a: jnp.sum(solve(*a) ** 2), argnums=(0, 1, 2, 3))
    assert sx.count_collectives(grad, *args).by_kind == {"all-gather": 2}


@pytest.mark.parametrize("name", ["pcg", "pcg_single_reduction", "pcg_pipelined", "pcg_s_step",
                                  "gmres", "bicgstab", "bicgstab_one_sync", "idrs", "minres"])
def test_vmap_batch_shares_each_reduction(name):
    """A batch of 4 right-hand sides under `vmap`: the same collectives as one
    (each reduction carries the batch's products), not 4 times as many."""
    m = mesh(8)
    d, b = krylov_args(m)
    B = put(jnp.stack([b, 2 * b, -b, 0.5 * b]), m, None, "i")
    f = jax.vmap(lambda b: REGISTRY[name].solve(diag_operator(d), b).x)
    report = sx.count_collectives(f, B)
    total, _, per_iteration = EXPECTED[name]
    assert (report.total, report.per_iteration) == (total, per_iteration), str(report)
