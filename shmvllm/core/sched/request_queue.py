"""The waiting queue: requests ordered by the scheduling policy's key.

Both policies use one heap keyed by `Request.sched_key`: (0, arrival sequence) for FCFS,
(priority, arrival sequence) for the priority policy (a lower value is served first, as in
vLLM). A preempted request keeps its key, so it returns to its place, ahead of later arrivals.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from shmvllm.core.request import Request


class RequestQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sched_key, request))

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty RequestQueue.")
        return self._heap[0][1]

    def pop(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty RequestQueue.")
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        """O(n): for aborts only."""
        for i, (_, queued) in enumerate(self._heap):
            if queued is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{request} is not in the waiting queue.")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, r in sorted(self._heap, key=lambda item: item[0]))
