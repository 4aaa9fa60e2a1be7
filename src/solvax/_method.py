"""The small mechanisms every Krylov method module uses, in one place.

A method (see `_driver`) is written from the driver's contract and these:

- `nonzero`, `masked_div`: divisions whose divisor may be zero where the
  result is not used (the step is flagged as a breakdown or not taken).
- `negligible`: a product that is zero up to its own rounding, the test for
  a breakdown of a short recurrence.
- `while_loop`: the iteration's loop, its starting state typed as the loop
  produces it inside `shard_map` (`Reduction.typed_like_results`).
- `Confirmation`, `confirmed_rounds`: a recursive residual's stopping test
  confirmed on the true residual (pipelined and s-step CG).

The start of an iteration (`Problem.start`, `Problem.setup`) and the
stopping threshold (`threshold`, `squared_threshold`) live on the driver's
`Problem`, which every method receives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import _reduce


def nonzero(value):
    """`value`, with 0 replaced by 1: the divisor of a quotient that is not
    used where the divisor is 0 (the step is flagged instead)."""
    return jnp.where(value == 0, jnp.ones_like(value), value)


def masked_div(pred, num, den):
    """`num / den` where `pred` holds, else 0, with the division last: XLA then
    computes the scalar once per step, where a final select would be fused
    into (and recompiled with) every vector update that reads it."""
    return jnp.where(pred, num, 0) / jnp.where(pred, den, 1)


def negligible(product, *scales):
    """`|product| <= 10 eps * prod(scales)`: zero up to the rounding of a
    product of vectors of those norms, so dividing by it (or by a coefficient
    made of it) would amplify rounding, not make progress. 10 eps, not more:
    100 eps stopped a float32 Poisson solve that converges."""
    bound = 10 * jnp.finfo(product.dtype).eps
    for scale in scales:
        bound = bound * scale
    return jnp.abs(product) <= bound


def while_loop(ip: _reduce.Reduction, like, cond: Callable, body: Callable, state):
    """`lax.while_loop(cond, body, state)`, the state first typed as the loop
    will produce it (`ip.typed_like_results(state, like)`): inside `shard_map`
    a solve of independent per-shard systems reduces locally, and a loop's
    carry must start with the type it ends with."""
    return lax.while_loop(cond, body, ip.typed_like_results(state, like))


class Confirmation(NamedTuple):
    """A method's own stopping test, confirmed on the true residual.

    Recurrences that update the residual (pipelined and s-step CG) can meet
    the tolerance on it while `b - A x` does not. Such a method runs in
    rounds (`confirmed_rounds`): when its own test says converged, the round
    ends with `pending` set and the next one restarts from `x` with the true
    residual (`fresh`), which the next step's reduction tests; a restart
    whose true residual is not below the previous restart's (`last`) means
    the attainable accuracy was reached (`stalled`: `STAGNATION`).
    """

    pending: jax.Array  # the own test met the tolerance: restart and test the true residual
    fresh: jax.Array  # the residual was just recomputed as b - A x
    last: jax.Array  # squared true residual at the previous restart (inf before one)
    stalled: jax.Array  # a restart did not lower the true residual: stop

    @classmethod
    def start(cls, real) -> Confirmation:
        false = jnp.bool_(False)
        return cls(pending=false, fresh=false, last=jnp.asarray(jnp.inf, real), stalled=false)

    def after_step(self, converged, rr, tol2) -> Confirmation:
        """After a step whose own test says `converged`, with squared residual
        `rr` (the true one when the step started `fresh`)."""
        return Confirmation(pending=converged & ~self.fresh, fresh=jnp.zeros_like(self.fresh),
                            last=jnp.where(self.fresh, rr, self.last),
                            stalled=self.fresh & ~(rr <= tol2) & (rr >= self.last))

    def restarted(self) -> Confirmation:
        """After the restart (taken where `pending`): the next step tests the true residual."""
        return self._replace(pending=~self.pending, fresh=self.pending)


def confirmed_rounds(ip: _reduce.Reduction, like, state, *, checks: Callable, going: Callable,
                     step: Callable, restart: Callable):
    """Rounds of `step` while `going(state)`, each after a `restart` where
    `checks(state).pending` (see `Confirmation`); `ip` and `like` type the
    state (`while_loop`). The restart sits outside the step: under `vmap` a
    conditional runs both branches, so one in the step would cost its matvec
    every step."""
    def round_(st):
        st = jax.lax.cond(checks(st).pending, restart, lambda st: st, st)
        return jax.lax.while_loop(going, step, st)

    return while_loop(ip, like, lambda st: going(st) | checks(st).pending, round_, state)
