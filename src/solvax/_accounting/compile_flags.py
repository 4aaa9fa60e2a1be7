"""XLA:CPU settings that make a compile cheaper without changing the HLO a
count reads: the main job (`python -m solvax`) and the tests use them.

No JAX import here: the flags must be in `XLA_FLAGS` before the CPU backend
starts, and importing this module starts nothing.

- LLVM's optimization level 0: the HLO passes and the SPMD partitioner, hence
  every collective counted, are the same at every level; only the machine
  code of the (tiny) programs is slower (measured: 14.4 s -> 7.2 s for the
  five programs of one mixed-layout IDR(s) case).
- XLA:CPU's older elemental emitters instead of its MLIR fusion emitters
  (the default in newer jaxlibs; 0.4.38 has only the older ones): about 1.7x
  over the test suite, the same HLO.
- LLVM's expensive passes off (an LLVM option): about 5% more.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import pathlib

BASE = ("--xla_backend_optimization_level=0",)
OPTIONAL = ("--xla_cpu_use_fusion_emitters=false", "--xla_llvm_disable_expensive_passes=true")


def jaxlib_knows(flag: str) -> bool:
    """Whether the installed jaxlib's XLA parses `flag` (its name is in one of
    its libraries): XLA aborts on an unknown flag, and the flags come and go
    between versions. Looked up without importing jaxlib."""
    name = flag.split("=")[0].lstrip("-")
    spec = importlib.util.find_spec("jaxlib")
    for lib in pathlib.Path(spec.origin).parent.rglob("*.so"):
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(name.encode()) >= 0:
                return True
    return False


def cheap_flags(devices: int | None = None) -> tuple:
    """The flags (with `devices` emulated CPU devices when given)."""
    flags = BASE + tuple(f for f in OPTIONAL if jaxlib_knows(f))
    if devices is not None:
        flags = (f"--xla_force_host_platform_device_count={devices}",) + flags
    return flags


def set_flags(flags: tuple) -> None:
    """`flags` into `XLA_FLAGS`, replacing any earlier value of each (call
    before the backend starts)."""
    names = {f.split("=")[0] for f in flags}
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(kept + list(flags))
