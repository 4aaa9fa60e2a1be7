"""The GPU lane: trust, speed and multigrid on one GPU, within a device loan.

`python benchmarks/gpu_lane.py [--small] [--out DIR] [--budget S] [--workers N]`

Made for one NVIDIA H200 lent for 15 minutes (start-up included), under the
image's JAX; it runs on any backend (`--small`: tiny sizes, CI's smoke run on
the CPU). Parts, each writing its results as it goes:

1. **trust** (`accelerator.py`, every registered solver x float32/float64 x
   none/Jacobi/multigrid, the structured solves, refinement, one gradient per
   method against finite differences; verdicts from float64 NumPy
   residuals): its cases split over `--workers` processes that compile in
   parallel, each with its own share of the budget.
2. **speed** (`accelerator_speed.py`, alone, after the trust part): the
   triad bandwidth, ms per step against jax.scipy beside each method's bytes
   at that bandwidth, at 1024^2 / 2048^2 / 4096^2, with Krylov loops that
   test every k = 1, 4, 8 (the GPU default), 16 steps
   (`SOLVAX_STEPS_PER_TEST`), and once more with XLA's command buffers for
   `WHILE` and `CONDITIONAL` on.
3. **multigrid**: MG-CG first calls and warm solves, V/W/F cycles, 1024^2 to
   4096^2 and 128^3 (`accelerator_speed.py --only multigrid`).

Writes `gpu_lane.json` and `gpu.md` (date, device, JAX version) under
`--out`, after every part, and prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: The trust part's case groups (`accelerator.py --only`), one process each.
TRUST_GROUPS = ("Krylov, diffusion", "Krylov, convection", "structured", "floor",
                "float64 from float32", "other preconditioners", "gradients")
#: Krylov steps per convergence test measured in the speed part.
STEPS = (1, 4, 8, 16)
COMMAND_BUFFERS = ("--xla_gpu_enable_command_buffer="
                   "FUSION,CUBLAS,CUDNN,CUSTOM_CALL,WHILE,CONDITIONAL")


def _run(args, env_extra=None, timeout=None, log=None):
    """A benchmark script in a fresh process; `(seconds, returncode, tail)`."""
    env = dict(os.environ)
    env.update(env_extra or {})
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *args], cwd=HERE, env=env, text=True,
                              capture_output=True, timeout=timeout)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, text = "timeout", (e.stdout or "") if isinstance(e.stdout, str) else ""
    if log:
        with open(log, "w") as f:
            f.write(text)
    return round(time.perf_counter() - start, 1), code, text[-2000:]


def trust(out: str, small: bool, budget: float, workers: int) -> dict:
    """`accelerator.py`'s case groups in parallel processes, `workers` at a
    time (`small`: the structured solves alone, the plumbing's smoke run)."""
    groups = ("structured",) if small else TRUST_GROUPS
    pending, running, rows = list(groups), [], {}
    share = budget / max(1, -(-len(groups) // workers))
    while pending or running:
        while pending and len(running) < workers:
            group = pending.pop(0)
            folder = os.path.join(out, f"trust_{group}")
            args = ["accelerator.py", "--out", folder, "--only", group,
                    "--budget", str(share)] + (["--small"] if small else [])
            env = dict(os.environ)
            running.append((group, folder, time.perf_counter(),
                            subprocess.Popen([sys.executable, *args], cwd=HERE, env=env,
                                             stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL)))
        for item in list(running):
            group, folder, start, proc = item
            if proc.poll() is None and time.perf_counter() - start < share + 60:
                continue
            if proc.poll() is None:
                proc.kill()
            running.remove(item)
            path = os.path.join(folder, "accelerator.json")
            cases = json.load(open(path)).get("rows", []) if os.path.exists(path) else []
            rows[group] = {"seconds": round(time.perf_counter() - start, 1),
                           "returncode": proc.returncode, "cases": len(cases),
                           "bad": [c for c in cases
                                   if not str(c.get("verdict", "ok")).startswith("ok")]}
            print(f"trust {group}: {len(cases)} cases, {len(rows[group]['bad'])} not ok, "
                  f"{rows[group]['seconds']} s", flush=True)
        time.sleep(0.5)
    return rows


def speed(out: str, small: bool, budget: float) -> dict:
    """`accelerator_speed.py --only krylov` for each k and with command
    buffers; each run's JSON kept."""
    rows = {}
    variants = [(f"k={k}", {"SOLVAX_STEPS_PER_TEST": str(k)}) for k in STEPS
                if not small or k in (1, 8)]
    if not small:   # the GPU's flag: measured where it means something
        variants.append(("k=8, command buffers WHILE+CONDITIONAL",
                         {"SOLVAX_STEPS_PER_TEST": "8",
                          "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " "
                                        + COMMAND_BUFFERS).strip()}))
    for label, env in variants:
        folder = os.path.join(out, "speed_" + label.split(",")[0].replace("=", ""))
        if "command" in label:
            folder += "_cmdbuf"
        args = ["accelerator_speed.py", "--out", folder, "--only", "krylov"]
        seconds, code, tail = _run(args + (["--small"] if small else []), env,
                                   timeout=budget / len(variants),
                                   log=os.path.join(out, f"{os.path.basename(folder)}.log"))
        path = os.path.join(folder, "accelerator_speed.json")
        rows[label] = {"seconds": seconds, "returncode": code,
                       "result": json.load(open(path)) if os.path.exists(path) else None}
        print(f"speed {label}: {seconds} s (exit {code})", flush=True)
    return rows


def multigrid(out: str, small: bool, budget: float) -> dict:
    folder = os.path.join(out, "multigrid")
    args = ["accelerator_speed.py", "--out", folder, "--only", "multigrid"]
    seconds, code, _ = _run(args + (["--small"] if small else []), timeout=budget,
                            log=os.path.join(out, "multigrid.log"))
    path = os.path.join(folder, "accelerator_speed.json")
    print(f"multigrid: {seconds} s (exit {code})", flush=True)
    return {"seconds": seconds, "returncode": code,
            "result": json.load(open(path)) if os.path.exists(path) else None}


def _krylov_rows(result) -> list:
    if not result:
        return []
    return [r for r in result.get("krylov", []) if isinstance(r, dict)]


def _cell(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def markdown(meta: dict, out: dict) -> str:
    lines = [f"# GPU lane: {meta['device']}", "",
             f"{meta['date']}, JAX {meta['jax']}, solvax {meta['solvax']}, "
             f"backend `{meta['backend']}`.", ""]
    if "trust" in out:
        lines += ["## Trust", "", "| group | cases | not ok | seconds |", "|---|---|---|---|"]
        lines += [f"| {g} | {r['cases']} | {len(r['bad'])} | {r['seconds']} |"
                  for g, r in out["trust"].items()]
        bad = [c for r in out["trust"].values() for c in r["bad"]]
        lines += [""] + [f"- {c.get('case', '?')}: {c.get('verdict')}" for c in bad] + [""]
    if "speed" in out:
        lines += ["## Speed (ms per step; ratio to the peer)", ""]
        for label, run in out["speed"].items():
            lines += [f"### {label}", ""]
            rows = _krylov_rows(run["result"])
            if not rows:
                lines += [f"(no rows: exit {run['returncode']})", ""]
                continue
            keys = ("problem", "method", "ms_per_step", "ratio", "passes_ms")
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
            lines.append("")
    if "multigrid" in out:
        lines += ["## Multigrid", "", f"{out['multigrid']['seconds']} s, exit "
                  f"{out['multigrid']['returncode']}; rows in `multigrid/accelerator_speed.json`",
                  ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny sizes (CI's smoke run)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "gpu_lane"))
    p.add_argument("--budget", type=float, default=420.0, help="seconds for the whole lane")
    p.add_argument("--workers", type=int, default=4, help="trust processes at a time")
    p.add_argument("--only", nargs="+", default=["trust", "speed", "multigrid"])
    args = p.parse_args()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            **_device(), "solvax": _version()}
    os.makedirs(args.out, exist_ok=True)
    out = {}
    parts = {"trust": (0.4, lambda b: trust(args.out, args.small, b, args.workers)),
             "speed": (0.35, lambda b: speed(args.out, args.small, b)),
             "multigrid": (0.25, lambda b: multigrid(args.out, args.small, b))}
    for name, (share, part) in parts.items():
        if name in args.only:
            out[name] = part(share * args.budget)
            _write(args.out, meta, out)
    print(markdown(meta, out))


def _device() -> dict:
    """The backend, device and JAX version, read by a child that exits: the
    parent never holds the device its parts run on (a TPU takes one program
    at a time)."""
    code = ("import json, jax; d = jax.devices()[0]; print(json.dumps({'backend': "
            "jax.default_backend(), 'device': f\"{d.platform}: {getattr(d, 'device_kind', '?')}\", "
            "'jax': jax.__version__}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _version() -> str:
    sys.path.insert(0, os.path.join(HERE, os.pardir, "src"))
    import solvax

    return solvax.__version__


def _write(folder: str, meta: dict, out: dict) -> None:
    with open(os.path.join(folder, "gpu_lane.json"), "w") as f:
        json.dump({"meta": meta, **out}, f, indent=1, default=str)
    with open(os.path.join(folder, "gpu.md"), "w") as f:
        f.write(markdown(meta, out))


if __name__ == "__main__":
    main()
