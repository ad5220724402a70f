"""PoolingModelRunner: runs an embedding model on one scheduler step and returns pooled vectors.

Unlike the generation runner it keeps no state between steps (no KV cache, no persistent
batch): every request arrives whole in `scheduled_new_reqs`, its tokens are packed with the
others' (no padding), run once through the model, pooled, and forgotten.

Models: BERT (the native packed encoder) and the Llama family (Llama, Mistral, Qwen2; causal
attention over each sequence's own fresh keys and values, no KV cache, usually last-token
pooling as e5-mistral-style embedders use).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from shmvllm.config import ModelConfig
from shmvllm.core.sched.output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from shmvllm.model.attention import AttentionMetadata, PrefillSeq
from shmvllm.model.bert import load_bert_model
from shmvllm.model.loader import MODEL_REGISTRY, get_model
from shmvllm.model.pooler import PoolerConfig, finalize, load_pooler_config, pool
from shmvllm.pooling_params import PoolingParams

_ENCODER_MODEL_TYPES = ("bert",)


class PoolingModelRunner:
    def __init__(self, model_config: ModelConfig, device: Optional[torch.device] = None) -> None:
        hf_config = model_config.hf_config
        architectures = getattr(hf_config, "architectures", None) or []
        self.is_decoder = any(a in MODEL_REGISTRY for a in architectures)
        if hf_config.model_type not in _ENCODER_MODEL_TYPES and not self.is_decoder:
            raise ValueError(
                f"model_type {hf_config.model_type!r} (architectures {architectures}) is not supported for "
                f"embedding; supported: {_ENCODER_MODEL_TYPES} and the architectures {sorted(MODEL_REGISTRY)}."
            )
        self.model_config = model_config
        self.device = torch.device(device if device is not None else model_config.device)
        self.dtype = getattr(torch, model_config.dtype)
        self.pooler_config: PoolerConfig = load_pooler_config(model_config.model_dir, model_config.hf_config)
        self.max_model_len = min(model_config.max_model_len, model_config.hf_config.max_position_embeddings)
        self.model: Optional[torch.nn.Module] = None

    @property
    def hidden_size(self) -> int:
        return self.model_config.hf_config.hidden_size

    def load_model(self) -> None:
        if self.is_decoder:
            self.model = get_model(self.model_config)
        else:
            self.model = load_bert_model(self.model_config.model_dir, self.model_config.hf_config, self.dtype, self.device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Embeds every request of the step; each must be a whole prompt scheduled at once."""
        if self.model is None:
            raise RuntimeError("PoolingModelRunner.execute_model called before load_model().")
        if scheduler_output.scheduled_cached_reqs.req_ids:
            raise ValueError(
                "pooling requests must be scheduled whole in one step, got cached requests "
                f"{scheduler_output.scheduled_cached_reqs.req_ids[:5]}."
            )
        reqs = scheduler_output.scheduled_new_reqs
        if not reqs:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        for req in reqs:
            self._check(req, scheduler_output.num_scheduled_tokens)
        # Packed by length, equal lengths sit together: the encoder attends each such run at once.
        by_length = sorted(reqs, key=lambda req: len(req.prompt_token_ids))
        with torch.inference_mode():
            vectors = self._embed(
                [req.prompt_token_ids for req in by_length], [req.pooling_params for req in by_length]
            )
        return ModelRunnerOutput(
            req_ids=[req.req_id for req in reqs],
            sampled_token_ids=[[] for _ in reqs],
            pooler_output={req.req_id: vec for req, vec in zip(by_length, vectors)},
        )

    def _check(self, req: NewRequestData, num_scheduled_tokens: dict[str, int]) -> None:
        prompt = req.prompt_token_ids
        if req.pooling_params is None:
            raise ValueError(f"request {req.req_id!r} has no pooling_params; this runner only embeds.")
        if not prompt:
            raise ValueError(f"request {req.req_id!r} has an empty prompt_token_ids.")
        if len(prompt) > self.max_model_len:
            raise ValueError(
                f"request {req.req_id!r}: prompt_token_ids has {len(prompt)} tokens, more than "
                f"max_model_len {self.max_model_len}."
            )
        scheduled = num_scheduled_tokens.get(req.req_id)
        if req.num_computed_tokens != 0 or scheduled != len(prompt):
            raise ValueError(
                f"request {req.req_id!r}: pooling needs the whole prompt in one step, got "
                f"num_scheduled_tokens {scheduled} and num_computed_tokens {req.num_computed_tokens} "
                f"for {len(prompt)} prompt tokens."
            )
        if req.pooling_params.dimensions is not None:
            req.pooling_params.verify(self.hidden_size)

    def _embed(self, prompts: list[list[int]], params: list[Optional[PoolingParams]]) -> list[np.ndarray]:
        lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        cu_seqlens = np.zeros(len(prompts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu_seqlens[1:])
        num_tokens = int(cu_seqlens[-1])
        input_ids = np.fromiter((t for p in prompts for t in p), dtype=np.int64, count=num_tokens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu_seqlens[:-1], lengths)
        hidden = self._forward(
            torch.from_numpy(input_ids).to(self.device), torch.from_numpy(positions).to(self.device), cu_seqlens.tolist()
        )
        pooled = pool(hidden, torch.from_numpy(cu_seqlens).to(self.device), self.pooler_config.pooling_type)
        rows = finalize(pooled.float(), params, self.pooler_config.normalize)
        return [row.cpu().numpy() for row in rows]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """Packed hidden states [num_tokens, H]; a decoder attends causally within each sequence."""
        assert self.model is not None
        if not self.is_decoder:
            return self.model(input_ids, positions, cu_seqlens)
        # No slot_mapping: the attention layers neither need nor touch a KV cache.
        meta = AttentionMetadata(
            slot_mapping=None, prefills=[PrefillSeq(s, e, None, None) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        )
        return self.model(input_ids, positions, meta)
