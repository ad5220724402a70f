"""IPC latency between two processes: the shared-memory ring against iceoryx2, pipes, ZeroMQ and
multiprocessing — `python -m ipc.bench` (see ipc/bench.py for the method) plus engine-shaped
msgspec messages (shmvllm.boundary.messages): an EngineCoreRequest with 32 and with 2,048 prompt
token ids, and an EngineCoreOutputs batch of 64 one-token outputs, encoded, sent, decoded,
re-encoded and sent back (the ring decodes in place from its memory, the others from bytes),
the rings of the size the engine's are.

    flock /tmp/shmvllm-cpu.lock python benchmarks/ipc_latency.py --quick \\
        --json benchmarks/results/ipc_latency.json --plot benchmarks/results/ipc_latency.png

Every case runs in `--repeats` rounds per payload (3 with --quick, 5 otherwise), the cases of a
round in an order rotated by one per round, so that a slow second of a shared machine spreads
over all transports instead of deciding one row. Prints the round-trip and throughput tables
(median over all rounds, the rounds' range in brackets), the shm / best-peer ratio of every row,
and one CHECK line per acceptance target, judged on the medians, with the number of rounds the
ring won it in (exit status 1 if one fails). Peers: `pip install -e .[bench]`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ipc.bench import Payload, main  # noqa: E402


def _message(name: str) -> Any:
    from shmvllm.boundary import messages as m
    from shmvllm.sampling_params import SamplingParams

    if name.startswith("req"):
        ids = m.EngineCoreRequest.pack_token_ids(range(int(name[3:])))
        params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95)
        return m.EngineCoreRequest("req-0000001", ids, params, arrival_time=time.time())
    outputs = [m.EngineCoreOutput(request_id=f"req-{i:07d}", new_token_ids=[1000 + i]) for i in range(64)]
    return m.EngineCoreOutputs(outputs=outputs, timestamp=time.time())


class _Make:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> Any:
        return _message(self.name)


class _Codec:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> tuple[Callable, Callable]:
        from shmvllm.boundary import messages as m

        decode = m.decode_to_engine if self.name.startswith("req") else m.decode_from_engine
        return m.make_encoder().encode, decode


def _engine_ring_capacity() -> int:
    from shmvllm.boundary.channel import ring_capacity

    return ring_capacity()


# The engine's messages travel in rings of the engine's capacity (4 MiB unless
# SHMVLLM_RING_CAPACITY says otherwise), as between the frontend and the engine.
MESSAGES = {name: Payload(name, _Make(name), _Codec(name), _engine_ring_capacity()) for name in ("req32", "req2048", "out64")}

if __name__ == "__main__":
    sys.exit(main(extra_payloads=MESSAGES, prog="benchmarks/ipc_latency.py"))
