"""The frontend<->engine process boundary, owned here and nowhere else.

- `messages`: every message type that crosses it and their one msgspec codec (numpy arrays as
  msgpack extensions); the neutral types the scheduler and the model runner hand over
  (`Logprobs`, `FinishReason`, `EngineCoreOutput(s)`) live here too, so that `shmvllm.core` and
  `shmvllm.worker` never import `shmvllm.engine`.
- `channel`: the `Endpoint` interface, its shared-memory implementation, and the one
  flow-control rule (with its no-deadlock argument).
"""
