"""Several processes, one mesh: `shardemu run ... --processes N`, or
`python -m shardemu.launch -n N -- run ...`.

The launcher starts N copies of the command on this machine. Each joins one JAX
distributed system (`jax.distributed.initialize`, the coordinator on a free local port)
with CPU collectives over gloo, brings `devices / N` virtual devices, and sees the
global mesh: the same code a cluster's hosts run, one per host. Process 0 writes the
run directory; the others keep theirs in a temporary folder that the launcher makes and
removes when the run ends, however they ended.

A process that fails takes the run with it: the launcher stops the others (SIGTERM,
then SIGKILL) and exits with the failed process's status and one line saying which.
Inside a process, JAX's heartbeat (`HEARTBEAT_S`) ends one whose peer vanished without
the launcher, instead of waiting on a collective for ever. A launcher killed outright
(SIGKILL, the kernel's out-of-memory killer) can stop nothing: each process watches it
(`watch_launcher`) and, once it is gone, sends itself SIGTERM, the stop a scheduler
asks for (the run finishes its step, checkpoints there if it checkpoints, and exits),
and a process other than 0 removes its copy of the run directory as it exits, which the
launcher no longer can.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ENV_ID, ENV_COUNT, ENV_COORDINATOR, ENV_SCRATCH, ENV_LAUNCHER = (
    "SHARDEMU_PROCESS_ID",
    "SHARDEMU_NUM_PROCESSES",
    "SHARDEMU_COORDINATOR",
    "SHARDEMU_SCRATCH",  # where a process other than 0 keeps its copy of the run directory
    "SHARDEMU_LAUNCHER_PID",  # the launcher's process id, which each process watches
)
HEARTBEAT_S = 10  # a peer silent this long is dead (jax.distributed's default is 100 s)
STOP_GRACE_S = 10  # after SIGTERM, how long the others get before SIGKILL
WATCH_S = 0.5  # how often a process looks for its launcher


def process_index() -> int | None:
    """This process's index when the launcher started it, else None."""
    value = os.environ.get(ENV_ID)
    return None if value is None else int(value)


def scratch_folder() -> str:
    """The folder a process other than 0 writes its copy of the run directory into."""
    return os.environ[ENV_SCRATCH]


def join(devices: int) -> None:
    """Join the launcher's distributed system with `devices` in all; call it before
    anything touches a JAX device."""
    import jax

    watch_launcher()
    count = int(os.environ[ENV_COUNT])
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", devices // count)
    jax.distributed.initialize(
        os.environ[ENV_COORDINATOR],
        num_processes=count,
        process_id=process_index(),
        initialization_timeout=120,
        heartbeat_timeout_seconds=HEARTBEAT_S,
    )


def watch_launcher() -> None:
    """Stop this process once the launcher that started it is gone (its parent is no
    longer the launcher: the process was handed to another), as the module docstring
    says; a thread of its own looks every `WATCH_S`. A process started otherwise (no
    launcher's id in its environment) has nothing to watch."""
    if ENV_LAUNCHER not in os.environ:
        return
    launcher = int(os.environ[ENV_LAUNCHER])

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(WATCH_S)
        if process_index() != 0:
            atexit.register(shutil.rmtree, scratch_folder(), ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="watch-launcher", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(count: int, argv: list[str]) -> int:
    """Run `shardemu ARGV` as `count` processes; their exit status (the first failure's)."""
    coordinator = f"127.0.0.1:{_free_port()}"
    # made and removed here, so that a process killed outright leaves none behind
    scratch = {i: tempfile.mkdtemp(prefix=f"shardemu-process-{i}-") for i in range(1, count)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "shardemu", *argv],
            env={
                **os.environ,
                ENV_ID: str(i),
                ENV_COUNT: str(count),
                ENV_COORDINATOR: coordinator,
                ENV_SCRATCH: scratch.get(i, ""),
                ENV_LAUNCHER: str(os.getpid()),
            },  # fmt: skip
            stdout=None if i == 0 else subprocess.DEVNULL,
        )
        for i in range(count)
    ]

    def forward(signum: int, _frame: object) -> None:
        """Ctrl-C or SIGTERM to the launcher reaches every process still running."""
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                _stop(procs)
                how = f"signal {-code}" if code < 0 else f"status {code}"
                print(
                    f"error: process {index} of {count} ended with {how}; the others were stopped",
                    file=sys.stderr,
                    flush=True,
                )
                return 128 - code if code < 0 else code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for folder in scratch.values():
            shutil.rmtree(folder, ignore_errors=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process still running, SIGKILL those that outlive the grace."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shardemu.launch", description=__doc__.splitlines()[0]
    )
    parser.add_argument("-n", type=int, required=True, help="processes")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- run ARGS...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.n < 1 or not command:
        parser.error("give -n N (N >= 1) and a command after --")
    return launch(args.n, command)


if __name__ == "__main__":
    sys.exit(main())
