"""Property-based checks (hypothesis) on random sizes and values."""

import jax.numpy as jnp
import numpy as np
from helpers import rel_err, solve_dense_tridiagonal
from hypothesis import given, settings
from hypothesis import strategies as st
from matrix import examples

import solvax as sx
from solvax._structured.tridiagonal import lax_supports


@settings(max_examples=examples(12), deadline=None)
@given(n=st.integers(1, 40), batch=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       method=st.sampled_from(["thomas", "lax", "auto"]))
def test_tridiagonal_matches_dense(n, batch, seed, method):
    rng = np.random.default_rng(seed)
    lower, upper = rng.standard_normal((2, n))
    diag = 2.5 + np.abs(lower) + np.abs(upper) + rng.random(n)  # strictly dominant
    rhs = rng.standard_normal((n, batch))
    if method == "lax" and not lax_supports(np.dtype("float64"), n):
        method = "thomas"
    x = sx.tridiagonal_solve(jnp.asarray(lower), jnp.asarray(diag), jnp.asarray(upper),
                             jnp.asarray(rhs), method=method)
    assert rel_err(x, solve_dense_tridiagonal(lower, diag, upper, rhs)) < 1e-12


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 5), shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)),
                                             min_size=1, max_size=3),
       seed=st.integers(0, 2**31 - 1))
def test_multi_dot_matches_numpy(k, shapes, seed):
    rng = np.random.default_rng(seed)
    xs = [[jnp.asarray(rng.standard_normal(s) + 1j * rng.standard_normal(s)) for s in shapes]
          for _ in range(k)]
    ys = [[jnp.asarray(rng.standard_normal(s)) + 0j for s in shapes] for _ in range(k)]
    got = sx.InnerProduct().multi_dot(list(zip(xs, ys)))
    ref = [sum(np.sum(np.conj(np.asarray(a)) * np.asarray(b)) for a, b in zip(x, y))
           for x, y in zip(xs, ys)]
    assert got.shape == (k,) and rel_err(got, ref) < 1e-13
