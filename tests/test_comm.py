"""`count_collectives` on functions whose collectives are known."""

import jax.numpy as jnp
from helpers import mesh, put
from jax import lax
from jax.sharding import PartitionSpec as P

import solvax as sx
from solvax._accounting.counter import analyze_hlo

M = mesh()


def test_no_communication():
    x = put(jnp.ones(64), M, "i")
    r = sx.count_collectives(lambda x: 2 * x + 1, x)
    assert r.total == 0 and r.setup == 0 and r.per_iteration == 0 and r.by_kind == {}
    assert "total 0" in str(r)


def test_sum_over_sharded_axis_is_one_all_reduce():
    x = put(jnp.ones(64), M, "i")
    r = sx.count_collectives(jnp.sum, x)
    assert r.total == 1 and r.setup == 1 and r.per_iteration == 0
    assert r.by_kind == {"all-reduce": 1} and r.bytes_by_kind == {"all-reduce": 8}


def test_psum_in_shard_map():
    x = put(jnp.ones(64), M, "i")
    f = sx.shard_map(lambda v: lax.psum(jnp.sum(v, keepdims=True), "i"), mesh=M,
                     in_specs=P("i"), out_specs=P())
    r = sx.count_collectives(f, x)
    assert r.total == 1 and r.count("all-reduce") == 1


def test_loop_with_one_reduction():
    x = put(jnp.ones(64), M, "i")

    def f(x):
        def body(c):
            k, v = c
            return k + 1, v / jnp.sum(v * v)

        return lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]

    r = sx.count_collectives(f, x)
    assert r.total == 1 and r.setup == 0 and r.per_iteration == 1
    assert r.bytes_per_iteration == 8
    assert len(r.loops) == 1 and r.loops[0].depth == 0


def test_nested_fixed_trip_loop_multiplies():
    x = put(jnp.ones(64), M, "i")

    def f(x):
        def inner(_, v):
            return v / jnp.sum(v * v)

        def body(c):
            k, v = c
            return k + 1, lax.fori_loop(0, 3, inner, v)

        s = jnp.sum(x)
        return lax.while_loop(lambda c: c[0] < 5, body, (0, x / s))[1]

    r = sx.count_collectives(f, x)
    assert r.total == 2 and r.setup == 1 and r.per_iteration == 3
    assert not r.unknown_trip_counts
    assert [loop.trip_count for loop in r.loops if loop.depth == 1] == [3]


def test_all_gather_is_counted():
    x = put(jnp.ones((8, 64)), M, None, "i")
    r = sx.count_collectives(lambda x: jnp.vdot(x, x), x)  # the trap in DESIGN.md
    assert r.count("all-gather") >= 1
    assert r.bytes_by_kind["all-gather"] >= 8 * 64 * 8


def test_async_pairs_counted_once():
    text = """
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %s = f32[4]{0} all-reduce-start(%p), replica_groups={}, to_apply=%add
  %d = f32[4]{0} all-reduce-done(%s)
  %g = (f32[4]{0}, f32[32]{0}) all-gather-start(%d), dimensions={0}
  ROOT %h = f32[32]{0} all-gather-done(%g)
}
"""
    r = analyze_hlo(text)
    assert r.total == 2 and r.by_kind == {"all-reduce": 1, "all-gather": 1}
    assert r.bytes_by_kind == {"all-reduce": 16, "all-gather": 128}


def test_unknown_nested_trip_count_is_flagged():
    x = put(jnp.ones(64), M, "i")

    def f(x):
        def inner(c):
            v, t = c
            return v / jnp.sum(v * v), t - 1

        def body(c):
            k, v = c
            return k + 1, lax.while_loop(lambda c: c[1] > 0, inner, (v, k))[0]

        return lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]

    r = sx.count_collectives(f, x)
    assert r.unknown_trip_counts and r.per_iteration == 1
    assert "unknown trip count" in str(r)


def test_a_variadic_all_reduce_counts_each_array_it_moves():
    """Two separate sums in a loop step: one tuple all-reduce on jax >= 0.7 (the
    combiner), two instructions before; executed per step, 2 arrays either
    way (XLA:CPU synchronizes once per array). One stacked sum: 1."""
    x = put(jnp.ones(64), M, "i")

    def loop(step):
        return lambda x: lax.fori_loop(0, 3, lambda _, v: step(v), x)

    separate = sx.count_collectives(loop(lambda v: v * (jnp.sum(v) + jnp.sum(v * v))), x)
    stacked = sx.count_collectives(loop(
        lambda v: v * jnp.sum(jnp.sum(jnp.stack([v, v * v]), axis=1))), x)
    assert separate.step_count("all-reduce") == 2, str(separate)
    assert separate.count("all-reduce") == (1 if sx._core.reduce.MERGES_ALL_REDUCES else 2)
    assert stacked.step_count("all-reduce") == stacked.count("all-reduce") == 1, str(stacked)
    assert "executed per step" in str(stacked)


def test_a_conditional_executes_its_busiest_branch():
    """A conditional inside a loop step with one reduction in one branch and
    two in the other: 3 instructions in the step, at most 2 executed."""
    x = put(jnp.ones(64), M, "i")

    def step(i, v):
        return lax.cond(i % 2 == 0, lambda v: v / jnp.sum(v),
                        lambda v: v / jnp.sum(jnp.sin(v)) / jnp.max(v), v)

    r = sx.count_collectives(lambda x: lax.fori_loop(0, 3, step, x), x)
    own = [c for c in r.collectives if c.loops and c.kind == "all-reduce"]
    assert len(own) == 3 and all(c.branches for c in own), str(r)
    assert r.step_count("all-reduce") == 2 and r.loop_count(r.step_loop, "all-reduce") == 2
