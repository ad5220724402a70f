"""EngineCoreClient: the LLMEngine's handle on the EngineCore, wherever that runs.

`make_client` picks the implementation: `SyncMPClient` (the engine in its own process, reached
over shared-memory rings; the default) or `InprocClient` (the engine in this process, which the
tests and debugging use). Both expose the same calls.
"""

from __future__ import annotations

import logging
import sys
from abc import ABC, abstractmethod
from typing import Any

from shmvllm.config import EngineConfig
from shmvllm.engine.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(config: EngineConfig, multiprocess: bool = True, transport: str = "shm") -> "EngineCoreClient":
        """SyncMPClient when multiprocess (its `transport` picks the channel), else InprocClient.

        Until this module defines SyncMPClient, multiprocess=True runs the engine in this process
        and says so in the log.
        """
        if multiprocess:
            mp_client = getattr(sys.modules[__name__], "SyncMPClient", None)
            if mp_client is not None:
                return mp_client(config, transport=transport)
            logger.warning("multiprocess=True, but SyncMPClient is not available yet: running the engine in-process")
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (may be empty)."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def get_stats(self) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def num_kv_blocks(self) -> int: ...

    @property
    @abstractmethod
    def block_size(self) -> int: ...


class InprocClient(EngineCoreClient):
    """Holds the EngineCore in this process: `get_output` runs one engine step."""

    def __init__(self, config: EngineConfig):
        from shmvllm.engine.core import EngineCore

        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def get_output(self) -> EngineCoreOutputs:
        if not self.engine_core.has_unfinished_requests():
            return EngineCoreOutputs()
        return self.engine_core.step()

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_stats(self) -> Any:
        return self.engine_core.get_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    @property
    def num_kv_blocks(self) -> int:
        return self.engine_core.num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.engine_core.block_size
