"""What the two multi-process executors share: worker programs (tensor-parallel ranks 1..N-1,
pipeline stages) started by this process and fed one command at a time over a broadcast ring
it writes. Who has died, one command to all, and stopping them."""

from __future__ import annotations

import pickle
import subprocess
import time
from typing import Any

from shmvllm.engine.exceptions import WorkerDeadError

SHUTDOWN_GRACE_S = 2.0


class WorkerProcs:
    """Subclasses set `ring` (an `ipc.broadcast.BroadcastWriter`), append to `procs`, and name
    their members: `GROUP` ('tensor-parallel workers'), `MEMBER` ('rank'), `FIRST_INDEX`."""

    GROUP = "workers"
    MEMBER = "worker"
    FIRST_INDEX = 0

    ring: Any
    procs: list[subprocess.Popen]

    def _dead(self) -> list[str]:
        """'rank r (pid p) exited with c' for each worker that is gone."""
        return [f"{self._member(index)} (pid {proc.pid}) exited with {proc.returncode}"
                for index, proc in enumerate(self.procs, start=self.FIRST_INDEX) if proc.poll() is not None]

    def _member(self, index: int) -> str:
        """How a log line names worker `index`."""
        return f"{self.MEMBER} {index}"

    def _command(self, *command: Any) -> None:
        """One command to every worker; WorkerDeadError where one is gone."""
        from ipc import PeerDeadError

        dead = self._dead()
        if dead:
            raise WorkerDeadError(f"{self.GROUP} died: {', '.join(dead)}")
        try:
            self.ring.push(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))
        except PeerDeadError as exc:
            raise WorkerDeadError(str(exc)) from exc

    def _stop_workers(self) -> None:
        """SHUTDOWN, then SIGKILL after a grace period; at once when one is dead (the others may
        be waiting on it), then closes the ring."""
        dead = self._dead()
        if self.procs and not dead:
            try:
                self.ring.push(pickle.dumps(("shutdown",)), timeout=0.05)
            except Exception:  # a full ring or a dead reader: the kill below ends them
                pass
        deadline = time.monotonic() + (0.0 if dead else SHUTDOWN_GRACE_S)
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.ring.close()
