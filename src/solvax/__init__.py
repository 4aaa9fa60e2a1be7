"""solvax: differentiable linear solvers that keep every leaf's sharding.

All communication is XLA collectives emitted for inner products, computed in
one reduction layer; `count_collectives` measures them. The modules are
private (this file re-exports the API; the solvers from the registry,
`_core.registry`); `solvax.distributed` is the public
multi-process submodule.
"""

from . import _krylov, _precision  # noqa: F401  (importing them registers the solvers)
from ._accounting.counter import CollectiveReport as CollectiveReport
from ._accounting.counter import count_collectives as count_collectives
from ._core import compat  # noqa: F401  (shims for the oldest supported JAX)
from ._core.parallel import shard_batch as shard_batch
from ._core.parallel import shard_map as shard_map
from ._core.reduce import InnerProduct as InnerProduct
from ._core.registry import SOLVERS as _SOLVERS
from ._core.solution import Solution as Solution
from ._core.solution import Status as Status
from ._grid.multigrid import Multigrid as Multigrid
from ._grid.multigrid import multigrid as multigrid
from ._grid.stationary import multigrid_solve as multigrid_solve
from ._grid.stencil import StencilOperator as StencilOperator
from ._grid.stencil import diffusion_operator as diffusion_operator
from ._grid.stencil import stencil_operator as stencil_operator
from ._krylov.recycling import RecycleSpace as RecycleSpace
from ._nonlinear.newton import NewtonSolution as NewtonSolution
from ._nonlinear.newton import newton_krylov as newton_krylov
from ._precision.narrowing import mixed_precision as mixed_precision
from ._preconditioners.diagonal import block_jacobi as block_jacobi
from ._preconditioners.diagonal import jacobi as jacobi
from ._preconditioners.polynomial import chebyshev as chebyshev
from ._preconditioners.polynomial import estimate_spectrum as estimate_spectrum
from ._structured.block_tridiagonal import BlockTridiagonalFactors as BlockTridiagonalFactors
from ._structured.block_tridiagonal import banded_solve as banded_solve
from ._structured.block_tridiagonal import block_tridiagonal_factor as block_tridiagonal_factor
from ._structured.block_tridiagonal import block_tridiagonal_solve as block_tridiagonal_solve
from ._structured.block_tridiagonal import (
    block_tridiagonal_solve_factored as block_tridiagonal_solve_factored,
)
from ._structured.block_tridiagonal import (
    cyclic_block_tridiagonal_solve as cyclic_block_tridiagonal_solve,
)
from ._structured.partitioned import (
    partitioned_block_tridiagonal_solve as partitioned_block_tridiagonal_solve,
)
from ._structured.partitioned import partitioned_tridiagonal_solve as partitioned_tridiagonal_solve
from ._structured.tridiagonal import cyclic_tridiagonal_solve
from ._structured.tridiagonal import tridiagonal_solve as tridiagonal_solve

# Every registered solver (importing `_krylov` and `_precision` registered
# them): `pcg`, `pcg_linear_solve`, `gmres`, `gcrot`, `bicgstab`, `idrs`,
# `minres`, `linear_solve`, `iterative_refinement`, ...
globals().update({_name: _solver.function for _name, _solver in _SOLVERS.items()})

__version__ = "0.1.0"

__all__ = [*_SOLVERS,
    "BlockTridiagonalFactors",
    "banded_solve",
    "block_tridiagonal_factor",
    "block_tridiagonal_solve",
    "block_tridiagonal_solve_factored",
    "CollectiveReport",
    "InnerProduct",
    "RecycleSpace",
    "Solution",
    "Status",
    "StencilOperator",
    "block_jacobi",
    "chebyshev",
    "count_collectives",
    "cyclic_block_tridiagonal_solve",
    "cyclic_tridiagonal_solve",
    "diffusion_operator",
    "estimate_spectrum",
    "jacobi",
    "mixed_precision",
    "Multigrid",
    "multigrid",
    "multigrid_solve",
    "newton_krylov",
    "NewtonSolution",
    "partitioned_block_tridiagonal_solve",
    "partitioned_tridiagonal_solve",
    "shard_batch",
    "shard_map",
    "stencil_operator",
    "tridiagonal_solve",
]
