"""Krylov methods on pytrees: CG and its variants (`cg`, `cg_steps`,
`pipelined`, `deflated`, `sstep`), the Arnoldi process (`arnoldi`), GMRES,
GCRO-DR (`gcrot`, `recycling`), BiCGStab, IDR(s), MINRES, `linear_solve`, and
the small mechanisms their steps share (`steps`).

Importing the package imports every module in it, so a method's module
registers it (`_core.registry`) with nothing else to edit."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
