"""Run a script on several local JAX processes (loopback), supervised from outside.

`launch` starts `num_processes` Python workers, each told its process id, the
process count and a free coordinator port through environment variables
(`SOLVAX_PROCESS_ID`, `SOLVAX_NUM_PROCESSES`, `SOLVAX_COORDINATOR`,
`SOLVAX_LOCAL_DEVICES`); a worker calls `initialize()` before touching any
device. The launcher gives the workers a clean environment (no inherited
`XLA_FLAGS` device count), writes each worker's output to a file, puts them
in their own process group, and kills exactly those groups if the deadline
passes. A surviving JAX process often dies by abort rather than by a Python
exception, and one whose peer vanished after collectives ran can hang
forever, so supervision from outside is the only safe design.

On a real cluster nothing of this is needed: call `jax.distributed.initialize()`
with no arguments under SLURM or Open MPI (one process per host or per GPU).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

ENV_PREFIX = "SOLVAX_"


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """How one worker ended: its exit code (None if it had to be killed) and output."""

    process_id: int
    returncode: int | None
    killed: bool
    output_path: str
    output_tail: str


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    workers: tuple[WorkerResult, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(w.returncode == 0 for w in self.workers)

    def report(self) -> str:
        lines = [f"{len(self.workers)} workers in {self.seconds:.1f} s"]
        for w in self.workers:
            state = "killed at the deadline" if w.killed else f"exit code {w.returncode}"
            lines.append(f"--- worker {w.process_id}: {state} ({w.output_path})")
            lines.append(w.output_tail.rstrip())
        return "\n".join(lines)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


def _tail(path: str, chars: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError as e:
        return f"<no output: {e}>"


def launch(script: str, args: Sequence[str] = (), *, num_processes: int = 2,
           local_devices: int = 4, timeout: float = 120.0, output_dir: str | None = None,
           env: dict[str, str] | None = None) -> LaunchResult:
    """Run `python script *args` as `num_processes` cooperating JAX processes.

    Every path ends the workers this call started: a normal return after they
    exit or are killed at the deadline, and any exception or interrupt
    (`KeyboardInterrupt` included) during start-up or supervision, which kills
    their process groups before it propagates.

    Args:
        script: path of the worker script (it calls `solvax.distributed.initialize()`).
        args: extra command-line arguments for every worker (a sequence of
            strings, not one string).
        num_processes: how many processes (>= 1).
        local_devices: CPU devices per process (>= 1).
        timeout: seconds until every still-running worker is killed (> 0).
        output_dir: where the `worker-K.log` files go (default: a new temporary folder).
        env: extra environment variables for the workers.

    Returns:
        A `LaunchResult`: each worker's exit code (or that it was killed) and
        the tail of its output; `.ok` and `.report()`.

    Raises:
        TypeError, ValueError: for arguments of the wrong type or range.
        OSError: if a worker or its log file cannot be started (the workers
            already started are killed first).
    """
    _check_launch_args(script, args, num_processes, local_devices, timeout)
    output_dir = output_dir or tempfile.mkdtemp(prefix="solvax-launch-")
    port = free_port()
    procs: list[subprocess.Popen] = []
    paths = [os.path.join(output_dir, f"worker-{k}.log") for k in range(num_processes)]
    start = time.monotonic()
    try:
        for k, path in enumerate(paths):
            worker_env = _clean_env({
                f"{ENV_PREFIX}PROCESS_ID": str(k),
                f"{ENV_PREFIX}NUM_PROCESSES": str(num_processes),
                f"{ENV_PREFIX}COORDINATOR": f"127.0.0.1:{port}",
                f"{ENV_PREFIX}LOCAL_DEVICES": str(local_devices),
                **(env or {}),
            })
            with open(path, "w") as out:
                procs.append(subprocess.Popen([sys.executable, script, *args], stdout=out,
                                              stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=worker_env,
                                              start_new_session=True))
        deadline = start + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        killed = [_kill_if_running(p) for p in procs]  # every path, exceptions included
    return LaunchResult(
        workers=tuple(WorkerResult(k, None if killed[k] else p.returncode, killed[k], paths[k],
                                   _tail(paths[k])) for k, p in enumerate(procs)),
        seconds=time.monotonic() - start)


def _kill_if_running(proc: subprocess.Popen) -> bool:
    """Kill the process group of a worker still running (only the group this
    launcher started); say whether it had to be killed."""
    if proc.poll() is not None:
        return False
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return True


def _check_launch_args(script, args, num_processes, local_devices, timeout) -> None:
    if not isinstance(script, (str, os.PathLike)):
        raise TypeError(f"`script` must be a path; got {type(script).__name__}.")
    if isinstance(args, (str, bytes)) or not all(isinstance(a, str) for a in args):
        raise TypeError("`args` must be a sequence of strings, e.g. ['--steps', '10']; "
                        f"got {args!r}.")
    for name, value in (("num_processes", num_processes), ("local_devices", local_devices)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an int >= 1; got {value!r}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"`timeout` must be a number of seconds > 0; got {timeout!r}.")


def initialize(*, timeout: int = 20) -> tuple[int, int]:
    """In a worker started by `launch`: configure CPU devices and gloo collectives
    and join the job. Call before anything touches a device.

    Returns:
        `(process_id, num_processes)`.

    Raises:
        RuntimeError: outside a worker started by `launch`.
    """
    import jax

    missing = [name for name in ("PROCESS_ID", "NUM_PROCESSES", "COORDINATOR", "LOCAL_DEVICES")
               if f"{ENV_PREFIX}{name}" not in os.environ]
    if missing:
        raise RuntimeError(
            "`solvax.distributed.initialize()` runs in a worker started by "
            f"`solvax.distributed.launch` (missing {', '.join(ENV_PREFIX + m for m in missing)}"
            "). On a cluster call `jax.distributed.initialize()` instead.")
    process_id = int(os.environ[f"{ENV_PREFIX}PROCESS_ID"])
    num_processes = int(os.environ[f"{ENV_PREFIX}NUM_PROCESSES"])
    devices = int(os.environ[f"{ENV_PREFIX}LOCAL_DEVICES"])
    try:
        jax.config.update("jax_num_cpu_devices", devices)
    except AttributeError:  # jax < 0.5: the XLA flag, read when the backend starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={devices}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    options = dict(coordinator_address=os.environ[f"{ENV_PREFIX}COORDINATOR"],
                   num_processes=num_processes, process_id=process_id,
                   cluster_detection_method="deactivate", initialization_timeout=timeout,
                   heartbeat_timeout_seconds=timeout, shutdown_timeout_seconds=timeout)
    accepted = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(**{k: v for k, v in options.items() if k in accepted})
    return process_id, num_processes
