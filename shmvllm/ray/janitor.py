"""A replica's janitor: a small detached process that unlinks the replica's rings once it is gone.

When Ray ends an actor (`ray.kill`, the end of a Ray Data pipeline, `ray stop`, a node going
down) it SIGKILLs the actor's process group and the actor's child processes; the engine is both,
so both ends of the rings die at once and neither unlinks them: they would stay in /dev/shm until
the next `LLM` on the node sweeps them. The janitor is neither: a launcher starts it in a session
of its own and exits, so it is re-parented away from the actor. It waits for the actor's process
to end, sweeps the segments of dead creators (`ipc.sweep_stale_segments`, the sweep an `LLM`
does when it starts) and exits. A replica that shuts down cleanly stops its janitor itself.

`python -m shmvllm.ray.janitor launch PID START_TIME` prints the janitor's pid and start time;
the janitor imports nothing but `ipc`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ipc.segment import pid_alive, process_start_time, sweep_stale_segments

POLL_S = 0.2
_LAUNCH_TIMEOUT_S = 60.0


class Janitor:
    """The janitor of the calling process (not its child: see the module's docstring)."""

    def __init__(self) -> None:
        pid = os.getpid()
        launcher = subprocess.run(
            [sys.executable, "-m", "shmvllm.ray.janitor", "launch", str(pid), str(process_start_time(pid))],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=_LAUNCH_TIMEOUT_S,
        )
        if launcher.returncode != 0:
            raise RuntimeError(f"the janitor's launcher failed (exit code {launcher.returncode}): {launcher.stderr[-2000:]}")
        self.pid, self.start_time = map(int, launcher.stdout.split())

    def stop(self) -> None:
        if pid_alive(self.pid, self.start_time):  # the same process, not a recycled pid
            os.kill(self.pid, signal.SIGKILL)


def _launch(pid: str, start_time: str) -> None:
    janitor = subprocess.Popen(
        [sys.executable, "-m", "shmvllm.ray.janitor", "watch", pid, start_time],
        start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    print(janitor.pid, process_start_time(janitor.pid))


def _watch(pid: int, start_time: int) -> None:
    while pid_alive(pid, start_time):
        time.sleep(POLL_S)
    sweep_stale_segments()


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "launch":
        _launch(*args)
    elif command == "watch":
        _watch(int(args[0]), int(args[1]))
    else:
        raise SystemExit(f"usage: python -m shmvllm.ray.janitor launch|watch PID START_TIME (got {command!r})")
