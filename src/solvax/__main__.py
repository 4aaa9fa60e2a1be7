"""`python -m solvax [--json PATH] [--case CASE ...]`: the communication table,
measured live on 8 emulated CPU devices (and written as JSON with `--json`;
only the rows named with `--case`). Each row prints as it is measured, with
its place and the time so far; the whole table follows at the end."""

import argparse
import os
import sys
import time

from ._accounting import compile_flags

# Before the CPU backend starts (importing jax alone does not start it): 8
# devices unless a count is set, and the compile settings that leave the HLO,
# hence every count, unchanged (`compile_flags`).
_DEVICES = ("xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""))
compile_flags.set_flags(compile_flags.cheap_flags(devices=8 if _DEVICES else None))

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
    print(flush=True)
    start = time.perf_counter()

    def progress(i, total, row):
        print(f"[{i + 1}/{total}, {time.perf_counter() - start:.0f} s] {table.format_row(row)}",
              flush=True)

    try:
        rows = table.measure(devices, cases=args.case, on_row=progress)
    except ValueError as e:  # an unknown case: say which there are
        parser.error(str(e))
    print()
    print(table.format_table(rows))
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.json:
        table.write_json(rows, args.json)


if __name__ == "__main__":
    main()
