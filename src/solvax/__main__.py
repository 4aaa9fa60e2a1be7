"""`python -m solvax [--json PATH] [--case CASE ...]`: the communication table,
measured live on 8 emulated CPU devices (and written as JSON with `--json`;
only the rows named with `--case`)."""

import argparse
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Must happen before the CPU backend starts; importing jax alone does not start it.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from ._accounting import table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m solvax", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--case", nargs="+", default=None, metavar="CASE",
                        help="only these rows (their names in the first column)")
    args = parser.parse_args()
    devices = min(8, len(jax.devices()))
    print(f"solvax communication table: jax {jax.__version__}, {devices} "
          f"{jax.devices()[0].platform.upper()} devices, 1-D mesh axis 'i'")
    print(table.MEANING)
    print()
    try:
        rows = table.measure(devices, cases=args.case)
    except ValueError as e:  # an unknown case: say which there are
        parser.error(str(e))
    print(table.format_table(rows))
    if args.json:
        table.write_json(rows, args.json)


if __name__ == "__main__":
    main()
