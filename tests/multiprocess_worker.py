"""A worker of tests/test_multiprocess.py: joins the job, runs every case on the
global 8-device mesh, checks its own shards against NumPy, prints a RESULT line.

    python tests/multiprocess_worker.py [--die-after-init PROCESS_ID]
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from solvax import distributed

DIE = sys.argv[1:2] == ["--die-after-init"]
process_id, num_processes = distributed.initialize(timeout=10 if DIE else 60)
if DIE and process_id == int(sys.argv[2]):
    print(f"process {process_id}: leaving on purpose after initialization", flush=True)
    os._exit(3)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from multiprocess_cases import cases  # noqa: E402

import solvax as sx  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("i",))
print(f"process {process_id}/{num_processes}: {len(jax.local_devices())} local of "
      f"{len(jax.devices())} devices", flush=True)
if DIE:  # the peer is gone: this collective must fail, not hang
    x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("i")),
                                     lambda idx: np.ones(8)[idx])
    print("sum:", jax.jit(lambda x: x.sum())(x), flush=True)
    sys.exit(0)


def global_array(value, spec):
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, P(*spec)),
                                        lambda idx: value[idx])


results, failures = {}, []
for name, (fn, specs, inputs, reference) in cases().items():
    if name == "tridiagonal_partitioned":
        fn = jax.tree_util.Partial(fn, mesh=mesh)
    args = [global_array(np.asarray(v), s) for v, s in zip(inputs, specs)]
    out = jax.jit(fn)(*args)
    worst = 0.0
    for got, ref in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(reference)):
        for shard in got.addressable_shards:
            want = np.asarray(ref)[shard.index]
            err = np.linalg.norm(np.asarray(shard.data) - want) / max(np.linalg.norm(want), 1e-300)
            worst = max(worst, float(err))
    report = sx.count_collectives(fn, *args)
    results[name] = {"error": worst, "total": report.total, "by_kind": report.by_kind,
                     "per_iteration": report.per_iteration}
    if not worst < 1e-10:
        failures.append(f"{name}: relative error {worst:.2e}")
    print(f"process {process_id}: {name}: error {worst:.1e}, collectives {report.by_kind}",
          flush=True)

print("RESULT " + json.dumps(results), flush=True)
if failures:
    print("FAILED: " + "; ".join(failures), flush=True)
    sys.exit(1)
