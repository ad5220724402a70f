"""PoolingModelRunner: runs a pooling model on one scheduler step and returns each request's
output: its embedding (task embed), its tokens' hidden states (token_embed), or its class
probabilities / score from the model's classification head (classify, score).

Unlike the generation runner it keeps no state between steps (no KV cache, no persistent
batch): every request arrives whole in `scheduled_new_reqs`, its tokens are packed with the
others' (no padding), run once through the model, pooled, and forgotten.

Models: the encoders of model/encoders.py (BERT, RoBERTa, XLM-RoBERTa, ModernBERT; packed, with
an optional classification head) and the decoder families (causal attention over each
sequence's own fresh keys and values, no KV cache, usually last-token pooling as Qwen3-Embedding
uses; EmbeddingGemma's Gemma 3 attends both ways and mean-pools).
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Optional

import numpy as np
import torch

from shmvllm.config import ModelConfig
from shmvllm.core.sched.output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from shmvllm.model.attention import AttentionMetadata, PrefillSeq
from shmvllm.model.encoders import ENCODER_MODEL_TYPES, is_classifier, load_encoder, max_positions, pooling_tasks
from shmvllm.model.loader import MODEL_REGISTRY, get_model
from shmvllm.model.models import decoder_architecture, family
from shmvllm.model.pooler import PoolerConfig, PoolingType, finalize, load_pooler_config, pool
from shmvllm.model.st_config import apply_activation, hf_classifier_activation, read_st_config
from shmvllm.pooling_params import PoolingParams


class PoolingModelRunner:
    def __init__(self, model_config: ModelConfig, device: Optional[torch.device] = None) -> None:
        hf_config = model_config.hf_config
        architectures = getattr(hf_config, "architectures", None) or []
        self.is_decoder = any(a in MODEL_REGISTRY for a in architectures)
        if hf_config.model_type not in ENCODER_MODEL_TYPES and not self.is_decoder:
            raise ValueError(
                f"model_type {hf_config.model_type!r} (architectures {architectures}) is not supported for "
                f"embedding; supported: {ENCODER_MODEL_TYPES} and the architectures {sorted(MODEL_REGISTRY)}."
            )
        if self.is_decoder and getattr(hf_config, "use_bidirectional_attention", False) and family(
            decoder_architecture(hf_config)
        ).options(hf_config).causal:
            # only Gemma 3 (EmbeddingGemma) reads the flag: another family is refused, not run causally
            raise ValueError(f"use_bidirectional_attention=True (architectures {architectures}) is supported for Gemma 3 only.")
        if self.is_decoder and is_classifier(hf_config):
            raise ValueError(f"architectures {architectures}: sequence classification is supported for {ENCODER_MODEL_TYPES} only.")
        self.model_config = model_config
        self.device = torch.device(device if device is not None else model_config.device)
        self.dtype = getattr(torch, model_config.dtype)
        self.pooler_config: PoolerConfig = load_pooler_config(model_config.model_dir, model_config.hf_config)
        user = model_config.pooler_config
        if user is not None and user.seq_pooling_type is not None:  # LLM(pooler_config=...) over the model's files
            self.pooler_config = dataclasses.replace(self.pooler_config, pooling_type=PoolingType[user.seq_pooling_type])
        self.tasks = pooling_tasks(hf_config)
        self.uses_token_types = not self.is_decoder and getattr(hf_config, "type_vocab_size", 1) > 1
        if is_classifier(hf_config):
            self.classify_activation = _classify_activation(hf_config)
            st_activation = read_st_config(model_config.model_dir, modules=False).activation or hf_classifier_activation(hf_config)
            self.score_activation = st_activation or self.classify_activation
        limit = hf_config.max_position_embeddings if self.is_decoder else max_positions(hf_config)
        self.max_model_len = min(model_config.max_model_len, limit)
        self.model: Optional[torch.nn.Module] = None
        self.head: Optional[torch.nn.Module] = None

    @property
    def hidden_size(self) -> int:
        return self.model_config.hf_config.hidden_size

    @property
    def embedding_size(self) -> int:
        return self.pooler_config.output_size(self.hidden_size)

    def load_model(self) -> None:
        if self.is_decoder:
            self.model = get_model(self.model_config)
        else:
            self.model, self.head = load_encoder(
                self.model_config.model_dir, self.model_config.hf_config, self.dtype, self.device
            )

    def warm_up(self, max_num_batched_tokens: int) -> None:
        """Before the first request (the engine calls it after load_model): keeps glibc's heap
        (keep_heap) and faults in what a step's pieces use of it, HEAP_ROWS_PER_TOKEN
        hidden-sized rows per token of the largest piece (at most HEAP_RESERVE_MAX_BYTES), so
        that the first large call's activations land on mapped pages instead of growing the heap."""
        keep_heap()
        element = torch.empty((), dtype=self.dtype).element_size()
        total = min(SUB_BATCH_TOKENS, max_num_batched_tokens) * HEAP_ROWS_PER_TOKEN * self.hidden_size * element
        # blocks under the mmap threshold come from the heap; zeroing them maps their pages
        blocks = [torch.zeros(_HEAP_BLOCK_BYTES, dtype=torch.uint8) for _ in range(-(-min(total, HEAP_RESERVE_MAX_BYTES) // _HEAP_BLOCK_BYTES))]
        del blocks

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
        vectors: list[np.ndarray] = []
        with torch.inference_mode():
            for part in _sub_batches(by_length, SUB_BATCH_TOKENS):
                vectors += self._embed([req.prompt_token_ids for req in part], [req.pooling_params for req in part])
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
        params = req.pooling_params
        task = self._task(params)
        if task not in self.tasks:
            raise ValueError(f"request {req.req_id!r}: task {task!r} is not supported by this model; it does {list(self.tasks)}.")
        types_from = (params.extra_kwargs or {}).get("compressed_token_type_ids")
        if types_from is not None and not (self.uses_token_types and types_from <= len(prompt)):
            raise ValueError(
                f"request {req.req_id!r}: extra_kwargs compressed_token_type_ids={types_from} "
                + ("exceeds the prompt's length." if self.uses_token_types else "but this model has no token types.")
            )
        if params.dimensions is not None:
            params.verify(self.embedding_size)

    def _task(self, params: PoolingParams) -> str:
        task = params.task or self.tasks[0]
        return "embed" if task == "encode" else task

    def _embed(self, prompts: list[list[int]], params: list[PoolingParams]) -> list[np.ndarray]:
        lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        cu_seqlens = np.zeros(len(prompts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu_seqlens[1:])
        num_tokens = int(cu_seqlens[-1])
        input_ids = np.fromiter((t for p in prompts for t in p), dtype=np.int64, count=num_tokens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu_seqlens[:-1], lengths)
        token_types = self._token_types(params, cu_seqlens, num_tokens)
        tasks = [self._task(p) for p in params]
        query_at = self._query_at(tasks, lengths)
        hidden = self._forward(
            torch.from_numpy(input_ids).to(self.device), torch.from_numpy(positions).to(self.device), cu_seqlens.tolist(),
            None if token_types is None else torch.from_numpy(token_types).to(self.device), query_at,
        )
        if query_at is not None:  # one hidden row per sequence: each its own one-token "sequence"
            cu_seqlens = np.arange(len(prompts) + 1, dtype=np.int64)
        cu = torch.from_numpy(cu_seqlens).to(self.device)
        out: list[Optional[np.ndarray]] = [None] * len(prompts)
        for task in set(tasks):
            rows = [i for i, t in enumerate(tasks) if t == task]
            for i, vec in zip(rows, self._task_outputs(task, hidden, cu, rows, [params[i] for i in rows])):
                out[i] = vec.float().cpu().numpy()
        return out  # type: ignore[return-value]

    def _task_outputs(
        self, task: str, hidden: torch.Tensor, cu: torch.Tensor, rows: list[int], params: list[PoolingParams]
    ) -> list[torch.Tensor]:
        """The outputs of the sequences `rows` (indices into the packed batch) for one task."""
        every = len(rows) == len(cu) - 1
        index = None if every else torch.tensor(rows, device=hidden.device)
        if task == "embed":
            pooled = pool(hidden, cu, self.pooler_config.pooling_type)
            if index is not None:
                pooled = pooled.index_select(0, index)
            return finalize(self.pooler_config.project(pooled).float(), params, self.pooler_config.normalize)
        if task == "token_embed":
            starts, ends = cu[:-1].tolist(), cu[1:].tolist()
            out = []
            for i, p in zip(rows, params):
                tokens = hidden[starts[i] : ends[i]].float()
                normalize = self.pooler_config.normalize if p.normalize is None else p.normalize
                out.append(torch.nn.functional.normalize(tokens, dim=-1) if normalize else tokens)
            return out
        assert self.head is not None
        logits = self.head(hidden, cu).float()
        if index is not None:
            logits = logits.index_select(0, index)
        activation = self.score_activation if task == "score" else self.classify_activation
        return [apply_activation(activation, row) if p.use_activation is not False else row for row, p in zip(logits.unbind(0), params)]

    def _query_at(self, tasks: list[str], lengths: np.ndarray) -> Optional[torch.Tensor]:
        """The offset of the one token each sequence's output reads, when every task of the step
        reads one token (CLS or last-token pooling, a CLS classification head), so that the
        encoder computes its last layer past the keys and values for those tokens only; None
        when some task reads more (mean pooling, token_embed) or the model is a decoder."""
        if self.is_decoder:
            return None
        reads = set()
        for task in set(tasks):
            if task == "embed":
                reads.add({PoolingType.CLS: "first", PoolingType.LAST: "last"}.get(self.pooler_config.pooling_type))
            elif task in ("classify", "score"):
                assert self.head is not None
                reads.add(None if self.head.mean_pooling else "first")
            else:
                reads.add(None)
        if reads == {"first"}:
            return torch.zeros(len(lengths), dtype=torch.int64, device=self.device)
        if reads == {"last"}:
            return torch.from_numpy(lengths - 1).to(self.device)
        return None

    def _token_types(
        self, params: list[PoolingParams], cu_seqlens: np.ndarray, num_tokens: int
    ) -> Optional[np.ndarray]:
        """Packed token type ids: 1 from each pair's second segment on (None: all zeros)."""
        firsts = [(p.extra_kwargs or {}).get("compressed_token_type_ids") for p in params]
        if all(f is None for f in firsts):
            return None
        types = np.zeros(num_tokens, dtype=np.int64)
        for start, end, first in zip(cu_seqlens[:-1], cu_seqlens[1:], firsts):
            if first is not None:
                types[start + first : end] = 1
        return types

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: list[int],
        token_types: Optional[torch.Tensor] = None,
        query_at: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Packed hidden states [num_tokens, H], or [num_seqs, H] of the tokens `query_at` names
        (encoders only); a decoder attends causally within each sequence."""
        assert self.model is not None
        if not self.is_decoder:
            return self.model(input_ids, positions, cu_seqlens, token_types, query_at)
        # No slot_mapping: the attention layers neither need nor touch a KV cache.
        meta = AttentionMetadata(
            slot_mapping=None, prefills=[PrefillSeq(s, e, None, None) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        )
        return self.model(input_ids, positions, meta)


SUB_BATCH_TOKENS = 4096
"""A step runs through the model in pieces of whole sequences of at most this many tokens (a
longer sequence alone): their activations (a 4,096-token QKV is 18 MB for MiniLM) stay under
glibc's 32 MB mmap threshold and so are reused between pieces, where a 16,384-token step's are
mapped and page-faulted afresh each time (8-12x the engine's minor faults): MiniLM's embed and
reranker ran 7% faster with one engine alive, 30-40% with six (benchmarks/results/embed.md,
"Encoder choices"); 4,096 beat 2,048."""


HEAP_ROWS_PER_TOKEN = 24
"""What warm_up faults in, in hidden-sized rows per token of a piece: MiniLM's activations and
the holes between them grew the engine's heap by ~100 MB (~16 such rows a token) in its first
1,000-pair score call; with 24 that call took ~1k minor faults instead of 30-44k
(benchmarks/results/embed.md, "The first large call")."""

HEAP_RESERVE_MAX_BYTES = 256 << 20
"""warm_up's cap: a larger model's activations of a piece pass glibc's 32 MB mmap threshold and
are mapped per call whatever the heap holds."""

_HEAP_BLOCK_BYTES = 8 << 20  # under glibc's mmap threshold (keep_heap), so from the heap


def keep_heap() -> None:
    """glibc's malloc keeps activations in its heap (mmap threshold fixed at its 32 MB maximum)
    and the freed top of the heap mapped (no trim), so that every step reuses the pages the
    warm-up faulted in instead of mapping and faulting them afresh. No-op without glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def _sub_batches(reqs: list[NewRequestData], max_tokens: int) -> list[list[NewRequestData]]:
    """reqs in order, cut into consecutive runs of at most max_tokens prompt tokens each."""
    parts: list[list[NewRequestData]] = []
    budget = 0
    for req in reqs:
        if not parts or len(req.prompt_token_ids) > budget:
            parts.append([])
            budget = max_tokens
        parts[-1].append(req)
        budget -= len(req.prompt_token_ids)
    return parts


def _classify_activation(hf_config: Any) -> str:
    """transformers' loss convention: regression raw, multi-label sigmoid, one label sigmoid,
    otherwise softmax over the labels (as vLLM's classify)."""
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return "Identity"
    if problem == "multi_label_classification" or hf_config.num_labels == 1:
        return "Sigmoid"
    return "Softmax"

