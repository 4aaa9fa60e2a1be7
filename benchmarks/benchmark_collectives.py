"""The seed's communication table for 1, 2, 4 and 8 emulated CPU devices.

    python benchmarks/benchmark_collectives.py [--json PATH] [--devices 1 2 4 8] [--case CASE ...]

Counts collective instructions in the optimized HLO of each compiled solve
(primal, and `jax.grad` of `sum(x**2)` for the adjoint) with
`solvax.count_collectives`, and prints one table per device count.
"""

import argparse
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from solvax._accounting import table as _table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--case", nargs="+", default=None, metavar="CASE",
                        help="only these rows (their names as printed; default: every row)")
    args = parser.parse_args()

    print(f"jax {jax.__version__}; {_table.MEANING}\n")
    rows = []
    for ndev in args.devices:
        measured = _table.measure(ndev, cases=args.case)
        rows += measured
        print(_table.format_table(measured), end="\n\n")
    if args.json:
        _table.write_json(rows, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
