"""Draw the benchmark figures from the saved results, one question per figure.

    python benchmarks/plot_results.py [--results DIR] [--out DIR]

Reads `convergence.json`, `convergence_cg.json` and `peers_latency.json`
from `--results` (default: benchmarks/results) and writes the figures the
documentation site shows to `--out` (default: docs/figures):

- `convergence_preconditioners.png`: which preconditioner helps which method?
  One panel per problem and method, one line style per preconditioner.
- `convergence_variants.png`: do the communication-saving variants converge
  like the standard methods? One panel per problem and family, one color per
  variant, no preconditioner.
- `convergence_sstep.png`: where does each s-step basis stop converging? The
  condition-2e8 problem, one color per basis, one line style per s.
- `latency.png`: what does one synchronization buy on a latency-bound mesh?
  Time per iteration of each CG and BiCGStab variant, with its all-reduces.
- `recycling.png`: what does a recycled space save along a sequence of
  systems? Matvecs per system of the nonsymmetric and the symmetric
  sequence (`recycling.json`, `recycling_symmetric.json`), one line per
  method.

The horizontal axis of the residual histories is operator applications
(matvecs), so methods with different work per step compare fairly: a run's
history of k recorded steps is spread over its counted matvecs.
Needs matplotlib (the `bench` or `test` extra).
"""

import argparse
import json
import pathlib
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
PRECOND_STYLES = {"none": "-", "jacobi": "--", "block_jacobi(16)": "-.", "chebyshev(4)": ":"}
FAMILY_COLORS = {"pcg": "tab:blue", "gmres": "tab:green", "bicgstab": "tab:red",
                 "idrs": "tab:purple", "minres": "tab:brown"}
REPRESENTATIVE = {"pcg": "pcg standard", "gmres": "gmres cgs2",
                  "bicgstab": "bicgstab standard", "idrs": "idrs s=4", "minres": "minres"}


def load(path):
    return json.loads(pathlib.Path(path).read_text())


def by_matvec(run):
    """(matvecs, relative residual) for a run's recorded history."""
    history = np.asarray(run["history"], dtype=float)
    return np.linspace(0, run["matvecs"], len(history)), history


def save(fig, path, caption, bottom, top=1.0):
    """The caption (problem and machine) under the panels, then the file."""
    fig.text(0.01, 0.005, textwrap.fill(caption, 190), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, bottom, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def about(meta):
    return f" jax {meta['jax']}, float64, CPU. Dotted grey line: the tolerance (rtol 1e-8)."


def panel(ax, title, tolerance=1e-8):
    ax.axhline(tolerance, color="0.5", ls=":", lw=0.8)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("operator applications (matvecs)", fontsize=7)
    ax.set_ylabel("relative residual", fontsize=7)
    ax.tick_params(labelsize=7)


def merged_runs(results_dir):
    """Every run, the CG rows from convergence_cg.json (the newer CG run)."""
    main, cg = load(results_dir / "convergence.json"), load(results_dir / "convergence_cg.json")
    cg_keys = {(r["problem"], r["solver"], r["precond"]) for r in cg["results"]}
    runs = [r for r in main["results"]
            if (r["problem"], r["solver"], r["precond"]) not in cg_keys]
    return runs + cg["results"], main


def preconditioners(runs, meta, path):
    """Which preconditioner helps which method: a panel per (problem, method)."""
    problems = [p for p in dict.fromkeys(r["problem"] for r in runs) if "contrast" not in p]
    cells = [(p, f) for p in problems for f in FAMILY_COLORS
             if any(r["problem"] == p and r["solver"] == REPRESENTATIVE[f] for r in runs)]
    cols = 3
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(11, 2.9 * rows + 0.4), squeeze=False)
    for ax, (problem, family) in zip(axes.flat, cells):
        for run in runs:
            if run["problem"] == problem and run["solver"] == REPRESENTATIVE[family] \
                    and run["history"]:
                ax.plot(*by_matvec(run), color=FAMILY_COLORS[family],
                        ls=PRECOND_STYLES[run["precond"]], lw=1.2)
        panel(ax, f"{problem}: {REPRESENTATIVE[family]}")
    for ax in list(axes.flat)[len(cells):]:
        ax.set_axis_off()
    handles = [plt.Line2D([], [], color="k", ls=s) for s in PRECOND_STYLES.values()]
    fig.legend(handles, [f"preconditioner: {p}" for p in PRECOND_STYLES], loc="upper center",
               ncol=4, fontsize=8, frameon=False)
    return save(fig, path, "Which preconditioner helps which method? One panel per problem and "
                "method (color), one line style per preconditioner; GMRES restarted every 30 "
                "steps. On the constant-diagonal Poisson and convection-diffusion operators "
                "Jacobi is a scaling and its line lies on the unpreconditioned one."
                + about(meta), 0.04, top=0.95)


def variants(runs, meta, path):
    """Do the communication-saving variants converge like the standard ones?"""
    cells = [("poisson", "pcg"), ("poisson", "gmres"), ("convection-diffusion", "bicgstab"),
             ("convection-diffusion", "idrs"), ("convection-diffusion", "gmres"),
             ("saddle-point", "minres gmres")]
    fig, axes = plt.subplots(2, 3, figsize=(11, 6.4))
    for ax, (problem, family) in zip(axes.flat, cells):
        chosen = [r for r in runs if r["problem"].startswith(problem) and r["precond"] == "none"
                  and r["solver"].split()[0] in family.split() and r["history"]
                  and "newton" not in r["solver"] and "monomial" not in r["solver"]
                  and "chebyshev" not in r["solver"]]
        colors = plt.cm.tab10(np.arange(len(chosen)) % 10)
        for k, (run, color) in enumerate(zip(chosen, colors)):
            # the first (the standard method) wide and pale, so that an
            # identical history drawn over it stays visible
            ax.plot(*by_matvec(run), color=color, lw=3.5 if k == 0 else 1.1,
                    alpha=0.35 if k == 0 else 1.0,
                    label=f"{run['solver']} ({run['status'].lower()})")
        title = chosen[0]["problem"] if chosen else problem
        panel(ax, f"{title}: {family.replace(' ', ' vs ')}, no preconditioner")
        ax.legend(fontsize=6, loc="lower left", frameon=False)
    return save(fig, path, "Do the communication-saving variants converge like the standard "
                "method? One panel per problem and family, one color per variant (the first, "
                "wide and pale, is the reference)." + about(meta), 0.05)


def sstep(runs, meta, path):
    """Where does each s-step basis stop converging (condition 2e8)?"""
    colors = {"chebyshev": "tab:blue", "newton": "tab:orange", "monomial": "tab:green"}
    styles = {2: "-", 4: "--", 8: ":"}
    hard = [r for r in runs if "contrast" in r["problem"] and r["history"]]
    preconds = list(dict.fromkeys(r["precond"] for r in hard))
    fig, axes = plt.subplots(1, len(preconds), figsize=(11, 3.8), squeeze=False)
    for ax, precond in zip(axes.flat, preconds):
        for run in hard:
            if run["precond"] != precond:
                continue
            words = run["solver"].split()
            if "s_step" in words:
                s, basis = int(words[2][2:]), words[3]
                ax.plot(*by_matvec(run), color=colors[basis], ls=styles[s], lw=1,
                        label=f"s={s} {basis} ({run['status'].lower()})")
            elif words[1] == "standard":
                ax.plot(*by_matvec(run), color="k", lw=2.5, alpha=0.3, label="pcg standard")
        panel(ax, f"{hard[0]['problem']}, preconditioner {precond}")
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    return save(fig, path, "Where does each s-step basis stop converging? High-contrast "
                "diffusion (condition 2e8); color: basis, line style: s." + about(meta), 0.04)


def latency(results_dir, path):
    """Time per iteration of each variant on the mesh, with its all-reduces."""
    data = load(results_dir / "peers_latency.json")
    rows = data["latency"]
    sizes = list(dict.fromkeys(r["problem"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(11, 4.0), squeeze=False)
    for ax, size in zip(axes.flat, sizes):
        chosen = [r for r in rows if r["problem"] == size]
        labels = [f"{r['solver'].replace('solvax ', '')} ({r['all_reduces_per_iteration']:g})"
                  for r in chosen]
        colors = [FAMILY_COLORS["bicgstab" if "bicgstab" in r["solver"] else "pcg"]
                  for r in chosen]
        bars = ax.barh(labels, [r["ms_per_iteration"] for r in chosen], color=colors)
        for bar, r, color in zip(bars, chosen, colors):
            if r["solver"].startswith("jax.scipy"):
                bar.set_fill(False)
                bar.set_hatch("///")
                bar.set_edgecolor(color)
        ax.invert_yaxis()
        ax.set_xlabel("time per iteration (ms)", fontsize=7)
        ax.set_title(f"{size}; (k): all-reduces per iteration", fontsize=8)
        ax.tick_params(labelsize=7)
    meta = data["meta"]
    return save(fig, path, "What does one synchronization buy on a latency-bound mesh? 8 "
                "emulated CPU devices, diagonal operator, 200 iterations, median of interleaved "
                "runs; hatched: jax.scipy; blue: CG, red: BiCGStab. "
                f"jax {meta['jax']}, {meta['cpu_count']} CPUs.", 0.04)


def recycling(results_dir, path):
    """Matvecs per system along each sequence, one line per method."""
    parts = [("nonsymmetric (convection-diffusion)",
              load(results_dir / "recycling.json")["sequence"]),
             ("symmetric (diffusion)", load(results_dir / "recycling_symmetric.json")["symmetric"])]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.0))
    for ax, (title, part) in zip(axes, parts):
        for name, row in part["rows"].items():
            style = "--" if "cold" in name else "-"
            ax.plot(range(1, len(row["per_system"]) + 1), row["per_system"], style, marker=".",
                    label=f"{name}: {row['matvecs']} ({row['matvecs_ratio']:.2f}x)")
        ax.set_title(f"{title}, {part['n']}^2, {part['steps']} backward-Euler steps", fontsize=8)
        ax.set_xlabel("system of the sequence", fontsize=7)
        ax.set_ylabel("matvecs (with a handed-on space's refresh)", fontsize=7)
        ax.set_ylim(bottom=0)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    return save(fig, path, "What does a recycled space save along a sequence? Each solve to "
                "rtol 1e-8 from the previous step's solution; legend: total matvecs and the "
                "ratio to the first method. One CPU device, float64.", 0.04)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results_dir = pathlib.Path(args.results)
    out = pathlib.Path(args.out or HERE.parent / "docs" / "figures")
    out.mkdir(parents=True, exist_ok=True)
    runs, meta = merged_runs(results_dir)
    for path in (preconditioners(runs, meta, out / "convergence_preconditioners.png"),
                 variants(runs, meta, out / "convergence_variants.png"),
                 sstep(runs, meta, out / "convergence_sstep.png"),
                 latency(results_dir, out / "latency.png"),
                 recycling(results_dir, out / "recycling.png")):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
