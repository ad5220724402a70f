"""DPLoadBalancer: which of N data-parallel engines gets the next request.

As vLLM's DP load balancer: an engine's load is `4 x waiting + running` (a waiting request
holds up everything behind it; a running one only shares the steps). The counts are the
engine's own, from the `SchedulerStats` it sends with every step's outputs, corrected by what
the client knows better: the requests it sent since that report and those that finished
(an offline `generate` adds all its prompts before any engine has reported, so the client's
own count is all there is at first). A request in flight, not yet in any report, counts as
waiting. Equal loads are compared by KV cache usage (in 1/16ths, so that near-equal usages tie),
and remaining ties go round robin. The children of an n > 1 request, and any request that
names a group, go where the group's first request went (they share a prompt: prefix caching).
"""

from __future__ import annotations

import itertools
from typing import Optional

from shmvllm.boundary.messages import SchedulerStats

WAITING_WEIGHT = 4
KV_USAGE_STEPS = 16


class DPLoadBalancer:
    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines
        self.unfinished = [0] * num_engines  # sent to the engine and not finished (the client's count)
        self.reported_running = [0] * num_engines
        self.kv_usage = [0.0] * num_engines
        self.served = [0] * num_engines  # requests each engine finished (or that were aborted there)
        self.owner: dict[str, int] = {}
        self._groups: dict[str, int] = {}  # group -> engine, while the group has requests
        self._group_of: dict[str, str] = {}
        self._group_size: dict[str, int] = {}
        self._turn = itertools.count()

    def load(self, engine: int) -> int:
        running = min(self.reported_running[engine], self.unfinished[engine])
        waiting = self.unfinished[engine] - running
        return WAITING_WEIGHT * waiting + running

    def choose(self, group: Optional[str] = None) -> int:
        """The engine for the next request (of `group`, if given)."""
        if group is not None and group in self._groups:
            return self._groups[group]
        keys = [(self.load(e), round(self.kv_usage[e] * KV_USAGE_STEPS)) for e in range(self.num_engines)]
        best = min(keys)
        ties = [e for e in range(self.num_engines) if keys[e] == best]
        return ties[next(self._turn) % len(ties)] if len(ties) > 1 else ties[0]

    def added(self, request_id: str, engine: int, group: Optional[str] = None) -> None:
        self.owner[request_id] = engine
        self.unfinished[engine] += 1
        if group is not None:
            self._groups.setdefault(group, engine)
            self._group_of[request_id] = group
            self._group_size[group] = self._group_size.get(group, 0) + 1

    def finished(self, request_id: str, served: bool = True) -> Optional[int]:
        """Forgets a finished (or aborted) request; its engine, or None if it was not known.
        served=False: it never reached the engine (its send failed)."""
        engine = self.owner.pop(request_id, None)
        if engine is None:
            return None
        self.unfinished[engine] -= 1
        self.served[engine] += served
        group = self._group_of.pop(request_id, None)
        if group is not None:
            self._group_size[group] -= 1
            if not self._group_size[group]:
                del self._group_size[group], self._groups[group]
        return engine

    def report(self, engine: int, stats: SchedulerStats) -> None:
        """An engine's counts, as it sent them with a step's outputs."""
        self.reported_running[engine] = stats.num_running_reqs
        self.kv_usage[engine] = stats.kv_cache_usage
