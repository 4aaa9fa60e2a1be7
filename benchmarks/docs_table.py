"""Rewrite the communication table in `docs/sharding.md` from the live table's
JSON (`python -m solvax --json benchmarks/results/table.json`), so the docs'
numbers come from a measurement, not from typing; `tests/test_docs.py` checks
that they agree.

`python benchmarks/docs_table.py [--json PATH] [--docs PATH]`
"""

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = ("| case | primal | adjoint | syncs/step | halos/step | all-gathers (primal + adjoint) "
          "| bytes/step |")


def table(rows) -> list[str]:
    lines = [HEADER, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['primal']} | {r['adjoint']} | {r['per_step']} | "
                     f"{r['halos_per_step']} | {r['all_gathers']} | {r['bytes_per_step']} |")
    return lines


def rewrite(text: str, rows) -> str:
    """`text` with the table that starts at `HEADER` replaced (up to its end)."""
    lines = text.split("\n")
    start = lines.index(HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + table(rows) + lines[end:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(ROOT / "benchmarks/results/table.json"))
    p.add_argument("--docs", default=str(ROOT / "docs/sharding.md"))
    args = p.parse_args()
    rows = json.loads(pathlib.Path(args.json).read_text())["rows"]
    path = pathlib.Path(args.docs)
    path.write_text(rewrite(path.read_text(), rows))
    print(f"wrote {len(rows)} rows into {path}")


if __name__ == "__main__":
    main()
