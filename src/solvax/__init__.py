"""solvax: differentiable linear solvers that keep every leaf's sharding.

All communication is XLA collectives emitted for inner products, computed in
one reduction layer; `count_collectives` measures them. The modules are
private: this file re-exports the API by name, and `__all__` is a literal
list (static tools such as the API reference's generator read it). The
registered solvers (`_core.registry.SOLVERS`) are imported by name too; a
test checks that they and `__all__` match the registry. `solvax.distributed`
is the public multi-process submodule.
"""

from . import _krylov, _precision  # noqa: F401  (importing them registers the solvers)
from ._accounting.counter import CollectiveReport as CollectiveReport
from ._accounting.counter import count_collectives as count_collectives
from ._core import compat  # noqa: F401  (shims for the oldest supported JAX)
from ._core.parallel import shard_batch as shard_batch
from ._core.parallel import shard_map as shard_map
from ._core.reduce import InnerProduct as InnerProduct
from ._core.solution import Solution as Solution
from ._core.solution import Status as Status
from ._grid.multigrid import Multigrid as Multigrid
from ._grid.multigrid import multigrid as multigrid
from ._grid.stationary import multigrid_solve as multigrid_solve
from ._grid.stencil import StencilOperator as StencilOperator
from ._grid.stencil import diffusion_operator as diffusion_operator
from ._grid.stencil import stencil_operator as stencil_operator
from ._krylov.bicgstab import bicgstab as bicgstab
from ._krylov.cg import pcg as pcg
from ._krylov.cg import pcg_linear_solve as pcg_linear_solve
from ._krylov.gcrot import gcrot as gcrot
from ._krylov.gmres import gmres as gmres
from ._krylov.idrs import idrs as idrs
from ._krylov.linear_solve import linear_solve as linear_solve
from ._krylov.minres import minres as minres
from ._krylov.recycling import RecycleSpace as RecycleSpace
from ._nonlinear.newton import NewtonSolution as NewtonSolution
from ._nonlinear.newton import newton_krylov as newton_krylov
from ._precision.narrowing import mixed_precision as mixed_precision
from ._precision.refinement import iterative_refinement as iterative_refinement
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
from ._structured.tridiagonal import cyclic_tridiagonal_solve as cyclic_tridiagonal_solve
from ._structured.tridiagonal import tridiagonal_solve as tridiagonal_solve

__version__ = "0.1.0"

__all__ = [  # a literal list of strings (read statically by the API reference)
    "banded_solve",
    "bicgstab",
    "block_jacobi",
    "block_tridiagonal_factor",
    "block_tridiagonal_solve",
    "block_tridiagonal_solve_factored",
    "BlockTridiagonalFactors",
    "chebyshev",
    "CollectiveReport",
    "count_collectives",
    "cyclic_block_tridiagonal_solve",
    "cyclic_tridiagonal_solve",
    "diffusion_operator",
    "estimate_spectrum",
    "gcrot",
    "gmres",
    "idrs",
    "InnerProduct",
    "iterative_refinement",
    "jacobi",
    "linear_solve",
    "minres",
    "mixed_precision",
    "multigrid",
    "Multigrid",
    "multigrid_solve",
    "newton_krylov",
    "NewtonSolution",
    "partitioned_block_tridiagonal_solve",
    "partitioned_tridiagonal_solve",
    "pcg",
    "pcg_linear_solve",
    "RecycleSpace",
    "shard_batch",
    "shard_map",
    "Solution",
    "Status",
    "stencil_operator",
    "StencilOperator",
    "tridiagonal_solve",
]
