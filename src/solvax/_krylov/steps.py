"""The small mechanisms every Krylov method module uses, in one place.

A method (see `_core/driver.py`) is written from the driver's contract and these:

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._core import reduce, target, tree

#: The divergence stop: a solve whose residual norm grows to this many times
#: its start's stops with `Status.DIVERGED` (communication-free: it reads
#: the norms the method reduces anyway). Measured (`docs/troubleshooting.md`):
#: CG on SPD 2-D diffusion problems that converge (64^2 and 256^2, contrast
#: up to 1e6, b = ones, random or a point, float32 and float64) grew at most
#: 74x; CG on a nonsymmetric 5-point stencil at 32^2 passed 10x at step 9,
#: 100x at 87 and 1000x at 856.
DIVERGENCE = 1e3


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


def while_loop(ip: reduce.Reduction, like, cond: Callable, body: Callable, state, *,
               per_step: bool = True):
    """`lax.while_loop(cond, body, state)`, the state first typed as the loop
    will produce it (`ip.typed_like_results(state, like)`): inside `shard_map`
    a solve of independent per-shard systems reduces locally, and a loop's
    carry must start with the type it ends with. A loop of steps
    (`per_step`) takes the target's form (`stepped`); a loop of rounds or
    restarts, each holding a loop of steps, stays one test per pass."""
    state = ip.typed_like_results(state, like)
    return stepped(cond, body, state) if per_step else lax.while_loop(cond, body, state)


def stepped(cond: Callable, body: Callable, state):
    """`lax.while_loop(cond, body, state)` in the target's form
    (`target.steps_per_test`): where that is k > 1 (a GPU), k steps in a
    counted inner loop (a trip count XLA knows: no predicate copied to the
    host) between two tests, each step's result selected only where `cond`
    held before it, so the steps after the loop would have stopped change
    nothing: `x`, the history and the counts are those of one test per
    step. The selection is elementwise with a scalar predicate: it fuses
    into the updates that produce the new state."""
    k = target.steps_per_test()
    if k == 1:
        return lax.while_loop(cond, body, state)
    return lax.while_loop(cond, lambda st: frozen_steps(cond, body, st, k), state)


def frozen_steps(cond: Callable, body: Callable, state, k: int):
    """`k` steps of `body` in a counted loop, each one's result selected only
    where `cond` held before it: the steps after `cond` fails change nothing."""
    def frozen(_, st):
        return tree.where(cond(st), body(st), st)

    return lax.fori_loop(0, k, frozen, state)


#: The largest fraction of its start's squared true residual a round of
#: `Confirmation` may end at (rounds shortened where they drift).
_SHORTEST = 0.1


class Confirmation(NamedTuple):
    """A method's own stopping test, confirmed on the true residual.

    Recurrences that update the residual (pipelined and s-step CG) can meet
    the tolerance on it while `b - A x` does not. Such a method runs in
    rounds (`confirmed_rounds`): when its own test says converged (or its
    recurrences can no longer be trusted), the round ends with `pending` set
    and the next one restarts from `x` with the true residual (`fresh`),
    which the next step's reduction tests; a restart whose true residual is
    not below the previous restart's (`last`) means the attainable accuracy
    was reached (`stalled`: `STAGNATION`). The start counts as a restart
    (its residual is `b - A x0`).

    With `kept` (`start(real, x)`, pipelined CG), the iterates of the last
    two restarts are kept in two slots, `best` naming the one with the lowest
    true residual: a stalled solve returns that one (`returned`), never the
    worse iterate it stalled on. Written only at restarts: no traffic in a
    step. Such a method also ends rounds on progress (`progressed`) and
    retries drifted rounds from the best iterate (`restart_point`); without
    `x` (s-step CG) the fields are None and rounds end on the own test alone.
    """

    pending: jax.Array  # the own test met the tolerance: restart and test the true residual
    fresh: jax.Array  # the residual was just recomputed as b - A x
    last: jax.Array  # squared true residual at the previous restart (inf before one)
    stalled: jax.Array  # a restart did not lower the true residual: stop
    kept: Any = None  # leaves (2, *shape): the iterates restarted from
    best: jax.Array | None = None  # the slot of `kept` with the lowest true residual
    own: jax.Array | None = None  # the own squared residual that ended the round
    progress: jax.Array | None = None  # a round ends when its own rr <= progress * last
    retrying: jax.Array | None = None  # the next round restarts from the best kept iterate

    @classmethod
    def start(cls, real, x=None) -> Confirmation:
        false, inf = jnp.bool_(False), jnp.asarray(jnp.inf, real)
        if x is None:
            return cls(pending=false, fresh=false, last=inf, stalled=false)
        kept = tree.tree_map(lambda v: jnp.stack([v, v]), x)
        eps = jnp.asarray(jnp.finfo(real).eps, real)
        return cls(pending=false, fresh=jnp.bool_(True), last=inf, stalled=false, kept=kept,
                   best=jnp.int32(0), own=inf, progress=eps, retrying=false)

    def progressed(self, rr):
        """A round's own squared residual fell by `progress` from its start's
        true one: end the round (van der Vorst & Ye's reliable updating:
        sqrt(eps) in norm, shortened where rounds drift; `after_step`)."""
        return rr <= self.progress * self.last

    def after_step(self, restart, rr, tol2) -> Confirmation:
        """After a step whose own test says `restart` (it met the tolerance, or
        its recurrences can no longer be trusted), with squared residual `rr`
        (the true one when the step started `fresh`)."""
        improved = self.fresh & (rr < self.last)
        best = None if self.best is None else jnp.where(improved, 1 - self.best, self.best)
        worse = self.fresh & ~(rr <= tol2) & (rr >= self.last)
        if self.kept is None:
            return self._replace(pending=restart & ~self.fresh, fresh=jnp.zeros_like(self.fresh),
                                 last=jnp.where(self.fresh, rr, self.last), stalled=worse)
        # The round drifted: its true residual came out above 4x its own, or
        # not below its start's (CG's error only falls in exact arithmetic).
        # The next rounds are shorter (progress -> sqrt(progress), at most
        # _SHORTEST); a round that did not improve is retried from here with
        # them (the best iterate stays kept) until rounds are shortest, and
        # only then stalls.
        worse = worse & ~(self.retrying & (rr <= self.last))  # a retry starts at the best
        drifted = self.fresh & (rr > 4 * self.own) | worse
        retry = worse & (self.progress < _SHORTEST)
        pending = (restart & ~self.fresh) | retry
        progress = jnp.where(drifted, jnp.minimum(jnp.sqrt(self.progress), _SHORTEST),
                             self.progress)
        return self._replace(pending=pending, fresh=jnp.zeros_like(self.fresh),
                             last=jnp.where(improved, rr, self.last), stalled=worse & ~retry,
                             best=best, own=jnp.where(pending, rr, self.own), progress=progress,
                             retrying=retry)

    def restart_point(self, x):
        """Where the next round starts: `x`, or on a retry the best kept iterate."""
        return self._best_where(self.retrying, x)

    def restarted(self, x=None) -> Confirmation:
        """After the restart from `x` (`restart_point`, taken where `pending`):
        the next step tests the true residual; `x` goes to the slot not
        holding the best."""
        kept = self.kept
        if kept is not None:
            kept = tree.tree_map(lambda k, v: k.at[1 - self.best].set(v), kept, x)
        return self._replace(pending=~self.pending, fresh=self.pending, kept=kept)

    def returned(self, x):
        """`x`, or where the solve stalled, the kept iterate with the lowest
        true residual."""
        return self._best_where(self.stalled, x)

    def _best_where(self, flag, x):
        """The best kept iterate where `flag`, else `x` (`x` without `kept`)."""
        if self.kept is None:
            return x
        return tree.tree_map(lambda k, v: jnp.where(flag, k[self.best], v), self.kept, x)


def confirmed_rounds(ip: reduce.Reduction, like, state, *, checks: Callable, going: Callable,
                     step: Callable, restart: Callable):
    """Rounds of `step` while `going(state)`, each after a `restart` where
    `checks(state).pending` (see `Confirmation`); `ip` and `like` type the
    state (`while_loop`).

    The restart is computed at every round and selected where pending (the
    first round's is discarded: one restart per solve), with no conditional
    over the vectors: on a TPU a conditional there made XLA keep the step's
    vectors in HBM instead of on-chip memory (pipelined CG at 2048^2: 0.32
    ms per step with it, 0.10 with the selection; 1024^2: 0.089 against
    0.022; `benchmarks/results/tpu.md`). The restart sits outside the step:
    under `vmap` a conditional runs both branches, so one in the step would
    cost its matvec every step."""
    def round_(st):
        st = tree.where(checks(st).pending, restart(st), st)
        return stepped(going, step, st)

    return while_loop(ip, like, lambda st: going(st) | checks(st).pending, round_, state,
                      per_step=False)
