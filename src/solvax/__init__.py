"""solvax: differentiable linear solvers that keep every leaf's sharding.

All communication is XLA collectives emitted for inner products, computed in
one reduction layer; `count_collectives` measures them.
"""

from ._reduce import InnerProduct as InnerProduct
from ._solution import Solution as Solution
from ._solution import Status as Status
from .cg import pcg as pcg
from .cg import pcg_linear_solve as pcg_linear_solve
from .comm import CollectiveReport as CollectiveReport
from .comm import count_collectives as count_collectives
from .gmres import gmres as gmres
from .linear_solve import linear_solve as linear_solve
from .parallel import shard_batch as shard_batch
from .parallel import shard_map as shard_map
from .partitioned import cyclic_tridiagonal_solve as cyclic_tridiagonal_solve
from .partitioned import partitioned_tridiagonal_solve as partitioned_tridiagonal_solve
from .precond import block_jacobi as block_jacobi
from .precond import chebyshev as chebyshev
from .precond import estimate_spectrum as estimate_spectrum
from .precond import jacobi as jacobi
from .tridiagonal import tridiagonal_solve as tridiagonal_solve

__version__ = "0.1.0"

__all__ = [
    "CollectiveReport",
    "InnerProduct",
    "Solution",
    "Status",
    "block_jacobi",
    "chebyshev",
    "count_collectives",
    "cyclic_tridiagonal_solve",
    "estimate_spectrum",
    "gmres",
    "jacobi",
    "linear_solve",
    "partitioned_tridiagonal_solve",
    "pcg",
    "pcg_linear_solve",
    "shard_batch",
    "shard_map",
    "tridiagonal_solve",
]
