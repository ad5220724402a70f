"""Attention over a paged KV cache: a C kernel for fp32 on the CPU, pure torch elsewhere.

Layout: each layer owns a key and a value cache of shape
[num_kv_heads, num_blocks, block_size, head_dim] (head-major). A token at position p of a
request lives in slot `block_table[p // block_size] * block_size + p % block_size` of each
head's flattened [num_blocks * block_size, head_dim] cache.

One step runs a flat batch of tokens from many requests: first every token's K/V is written
to its slot (slot_mapping), then
- decode requests (one new token each) attend together in two batched matmuls and a softmax,
  over their context gathered from the cache whole blocks at a time (padded to the longest
  request's blocks, masked by an additive -inf bias). The head-major layout makes the gathered
  keys [kv_heads, num_decodes, blocks * block_size, head_dim] without a copy, and grouped
  queries attend as [kv_heads * num_decodes, group, head_dim], so K/V are never repeated.
  Every gathered slot must hold finite values (0 * NaN is NaN): the model runner zeroes
  blocks when it first sees them, and padding reads block 0;
- prefill requests (a chunk of prompt, maybe after a cached prefix) attend one by one: over
  their fresh K/V when nothing precedes the chunk, else over the context gathered from the
  cache with a causal mask shifted by the prefix length.

Per layer, three options of the decoder families: a sliding window (the query at position p sees
the keys at positions > p - window, as transformers' sliding-window mask), Gemma 2's
soft-capping of the scores (cap * tanh(score / cap), before the mask), and gpt-oss's sinks (a
learned logit per query head that joins the softmax's denominator and weighs no value; the C
decode kernel takes them, prefills run eagerly, SDPA having no place for them). A bidirectional layer
(EmbeddingGemma's, pooling only) attends a whole fresh sequence both ways, its window the keys
closer than `window` either side. The cache keeps every
block of a request for every layer (a block that only sliding layers could drop is kept for the
global ones), so prefix caching, chunked prefill and preemption work on it unchanged; a sliding
layer just reads the last `window` positions.
Everything that does not depend on the layer (gather indices, masks) is built once per step
by `build_attention_metadata`.

On the CPU with fp32 caches, the cache write and the decode attention run in the C kernels of
`shmvllm.model.kernels` instead (when they built): each decode request reads its K/V straight
from its blocks, with no gathered copy. A causal prefill chunk whose context is at most
NATIVE_PREFILL_MAX_LEN tokens runs there too, each of its tokens a decode row over its own prefix
(the chunk's K/V are in the cache by then); longer ones stay in torch (SDPA). The torch path is the
reference the kernels are tested against, and what CUDA and other dtypes use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from shmvllm.model.kernels import kernels_for


NATIVE_PREFILL_MAX_LEN = 256
"""The longest context a prefill chunk attends over as decode rows in the C kernel. SmolLM2's 9
heads, one thread pair: 134 against SDPA's 316 us at 85 tokens, 0.98 against 1.31 ms at 256, even
at 512, slower beyond (each row reads its whole prefix; SDPA reuses each key block)."""


class PrefillRows:
    """A prefill chunk as decode rows: row i of [start, end) over num_computed + i + 1 positions
    of one block-table row (the C kernel's table stride 0). The arrays live as long as the step's
    metadata; the kernel reads them through `pointers`."""

    def __init__(self, start: int, end: int, num_computed: int, block_row: np.ndarray) -> None:
        self.count = end - start
        self.rows = np.arange(start, end, dtype=np.int64)
        self.block_row = np.ascontiguousarray(block_row, dtype=np.int32)
        self.seq_lens = np.arange(num_computed + 1, num_computed + self.count + 1, dtype=np.int32)
        self.pointers = tuple(a.__array_interface__["data"][0] for a in (self.rows, self.block_row, self.seq_lens))


@dataclass
class PrefillSeq:
    """One request's chunk of > 1 tokens: rows [start, end) of the flat batch."""

    start: int
    end: int
    context_slots: Optional[torch.Tensor]  # [seq_len] cache slots of the whole context; None: no prefix
    mask: Optional[torch.Tensor]  # [chunk_len, seq_len] bool, True = may attend; None: plain causal
    num_computed: int = 0  # context positions before the chunk
    masks: dict = field(default_factory=dict)  # (window, causal) -> the mask of a sliding layer, built once a step
    as_rows: Optional[PrefillRows] = None  # set where the C kernel may attend it (NATIVE_PREFILL_MAX_LEN)

    def window_mask(self, window: int, device: torch.device, causal: bool = True) -> torch.Tensor:
        """[chunk_len, seq_len] bool: causal and within the last `window` positions; not causal:
        within `window` - 1 positions either side."""
        mask = self.masks.get((window, causal))
        if mask is None:
            chunk = self.end - self.start
            query_pos = torch.arange(self.num_computed, self.num_computed + chunk, device=device)[:, None]
            key_pos = torch.arange(self.num_computed + chunk, device=device)[None, :]
            if causal:
                mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
            else:
                mask = (key_pos - query_pos).abs() < window
            self.masks[(window, causal)] = mask
        return mask


@dataclass
class AttentionMetadata:
    slot_mapping: Optional[torch.Tensor]  # [num_tokens] int64; None: do not touch the cache (profiling)
    decodes: Optional["DecodeBatch"] = None  # the requests with one new token, if any
    prefills: list[PrefillSeq] = field(default_factory=list)
    # [num_tokens] int64 max(prompt length, position + 1) per token, for rope types that depend
    # on the sequence's length (rotary.py); None where the model does not need it
    rope_lengths: Optional[torch.Tensor] = None


@dataclass
class DecodeBatch:
    """The decode requests of a step. The C kernel reads the numpy arrays through their
    addresses; the torch path's gather inputs are derived from them on first use, once a step."""

    rows: np.ndarray  # [num_decodes] int64 rows of the flat batch
    block_table: np.ndarray  # [num_decodes, width] int32, C-contiguous
    seq_lens: np.ndarray  # [num_decodes] int32
    block_size: int
    device: torch.device

    def __post_init__(self) -> None:
        self.pointers = tuple(a.__array_interface__["data"][0] for a in (self.rows, self.block_table, self.seq_lens))
        self.are_prefix = bool(self.rows[-1] == len(self.rows) - 1)  # rows are exactly [0, num_decodes)
        self.bias_cache: dict = {}  # (kv_heads, group, dtype) -> expanded length mask

    @functools.cached_property
    def token_idx(self) -> torch.Tensor:
        return torch.from_numpy(self.rows).to(self.device)

    @functools.cached_property
    def gather(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(block ids [num_decodes * max_blocks], padded with block 0; additive length mask
        [num_decodes, 1, max_len] of 0 / -inf; max_len = max_blocks * block_size)."""
        block_size = self.block_size
        max_blocks = int(-(-self.seq_lens.max() // block_size))
        max_len = max_blocks * block_size
        num_blocks = -(-self.seq_lens // block_size)
        valid = np.arange(max_blocks)[None, :] < num_blocks[:, None]
        blocks = np.where(valid, self.block_table[:, :max_blocks], 0).reshape(-1).astype(np.int64)
        bias = np.where(np.arange(max_len)[None, :] < self.seq_lens[:, None], np.float32(0.0), np.float32(-np.inf))
        return torch.from_numpy(blocks).to(self.device), torch.from_numpy(bias[:, None, :]).to(self.device), max_len


def build_attention_metadata(
    query_lens: np.ndarray,
    num_computed: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    device: torch.device,
    verify: Optional[np.ndarray] = None,
) -> AttentionMetadata:
    """query_lens / num_computed: per scheduled request, in batch order; block_table: their rows
    [num_reqs, max_blocks] (int32); slot_mapping: [num_tokens] for the flat batch. verify: the
    requests whose tokens (proposals being verified) each attend as a decode row of their own,
    row i over num_computed + i + 1 tokens: every layer writes all rows' KV before attention
    reads it, so this is causal, and a short verification takes the decode paths (the native
    decode step among them)."""
    seq_lens = num_computed + query_lens
    starts = np.concatenate(([0], np.cumsum(query_lens)[:-1]))
    is_decode = query_lens == 1
    meta = AttentionMetadata(slot_mapping=torch.from_numpy(slot_mapping.astype(np.int64)).to(device))
    if verify is not None and verify.any():
        is_decode = is_decode | verify
        reqs = np.flatnonzero(is_decode)
        widths = query_lens[reqs]
        offsets = np.arange(int(widths.sum())) - np.repeat(np.cumsum(widths) - widths, widths)
        meta.decodes = DecodeBatch(
            np.ascontiguousarray(np.repeat(starts[reqs], widths) + offsets, dtype=np.int64),
            np.ascontiguousarray(np.repeat(block_table[reqs], widths, axis=0), dtype=np.int32),
            np.ascontiguousarray(np.repeat(num_computed[reqs], widths) + offsets + 1, dtype=np.int32),
            block_size,
            device,
        )
    elif is_decode.any():
        meta.decodes = DecodeBatch(
            np.ascontiguousarray(starts[is_decode], dtype=np.int64),
            np.ascontiguousarray(block_table[is_decode], dtype=np.int32),
            np.ascontiguousarray(seq_lens[is_decode], dtype=np.int32),
            block_size,
            device,
        )
    for i in np.flatnonzero(~is_decode):
        start, end = int(starts[i]), int(starts[i] + query_lens[i])
        meta.prefills.append(_prefill_seq(start, end, int(num_computed[i]), block_table[i], block_size, device))
    return meta


def _prefill_seq(
    start: int, end: int, num_computed: int, block_row: np.ndarray, block_size: int, device: torch.device
) -> PrefillSeq:
    seq_len = num_computed + end - start
    rows = PrefillRows(start, end, num_computed, block_row) if seq_len <= NATIVE_PREFILL_MAX_LEN else None
    if num_computed == 0:
        return PrefillSeq(start, end, None, None, as_rows=rows)
    positions = np.arange(seq_len)
    slots = block_row[positions // block_size].astype(np.int64) * block_size + positions % block_size
    query_pos = np.arange(num_computed, seq_len)
    mask = positions[None, :] <= query_pos[:, None]
    return PrefillSeq(start, end, torch.from_numpy(slots).to(device), torch.from_numpy(mask).to(device), num_computed,
                      as_rows=rows)


class PagedAttention(torch.nn.Module):
    """Self-attention of one layer; q/k/v come in flat as [num_tokens, heads, head_dim].
    causal=False: each prefill sequence attends to all of its own tokens (no cached prefix, no decodes)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        sliding_window: Optional[int] = None, softcap: Optional[float] = None, causal: bool = True, sinks: bool = False,
    ) -> None:
        super().__init__()
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}.")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be a positive number or None, got {softcap!r}.")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.causal = causal
        # sinks: a learned logit per query head that joins each softmax's denominator and weighs no value (gpt-oss)
        self.sinks = torch.nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None
        self.k_cache: Optional[torch.Tensor] = None  # bound by the model runner
        self.v_cache: Optional[torch.Tensor] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        kernels = self._kernels(q, k, v)
        k_flat = v_flat = None
        if meta.slot_mapping is not None:
            if self.k_cache is None or self.v_cache is None:
                raise RuntimeError("PagedAttention has no KV cache bound; call initialize_kv_cache first.")
            k_flat = self.k_cache.view(self.num_kv_heads, -1, self.head_dim)
            v_flat = self.v_cache.view(self.num_kv_heads, -1, self.head_dim)
            if kernels is not None:
                kernels.shm_write_kv_cache(
                    k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), meta.slot_mapping.data_ptr(), k.shape[0],
                    k_flat.data_ptr(), v_flat.data_ptr(), k_flat.shape[1], self.num_kv_heads, self.head_dim,
                )
            else:
                k_flat.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
                v_flat.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        out = torch.empty_like(q)
        if not self.causal and (meta.decodes is not None or any(seq.context_slots is not None for seq in meta.prefills)):
            raise ValueError("bidirectional attention runs whole fresh sequences only (pooling), not decodes or cached prefixes.")
        if meta.decodes is not None:
            if meta.slot_mapping is None or self.k_cache is None or self.v_cache is None:
                raise RuntimeError("decode needs the KV cache (got metadata without slot_mapping).")
            if kernels is not None:
                batch = meta.decodes
                self._attend_rows(kernels, q, batch.pointers, len(batch.rows), batch.block_table.shape[1], out)
            else:
                self._decode(q, meta.decodes, out)
        for seq in meta.prefills:
            if kernels is not None and self.causal and seq.as_rows is not None and meta.slot_mapping is not None:
                self._attend_rows(kernels, q, seq.as_rows.pointers, seq.as_rows.count, 0, out)
            else:
                out[seq.start : seq.end] = self._prefill(q, k, v, k_flat, v_flat, seq)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _kernels(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        """The C kernels when they apply: CPU, fp32 everywhere, rows of [heads, head_dim]."""
        cache, d = self.k_cache, self.head_dim
        if cache is None or not cache.is_contiguous() or any(t.stride(2) != 1 or t.stride(1) != d for t in (q, k, v)):
            return None
        return kernels_for(q, cache)

    def _attend_rows(self, kernels: Any, q: torch.Tensor, pointers: tuple[int, int, int], count: int, table_stride: int,
                     out: torch.Tensor) -> None:
        """The C decode kernel over `count` rows: pointers to their row indices, block-table rows
        (`table_stride` apart) and context lengths."""
        k_cache, v_cache = self.k_cache, self.v_cache
        assert k_cache is not None and v_cache is not None and v_cache.is_contiguous()
        rows, table, seq_lens = pointers
        sinks = None if self.sinks is None else self.sinks.float().contiguous()  # the kernel reads fp32 sinks
        status = kernels.shm_paged_decode_attention_ex(
            out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0), rows, count,
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1] * k_cache.shape[2], table,
            table_stride, seq_lens, k_cache.shape[2], self.num_heads, self.num_kv_heads,
            self.head_dim, self.scale, self.sliding_window or 0, self.softcap or 0.0,
            None if sinks is None else sinks.data_ptr(),
        )
        if status != 0:
            raise MemoryError("the decode attention kernel could not allocate its scratch memory")

    def _decode(self, q: torch.Tensor, batch: DecodeBatch, out: torch.Tensor) -> None:
        assert self.k_cache is not None and self.v_cache is not None
        blocks, _, length = batch.gather
        n, kv_heads, d = len(batch.rows), self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        keys = self.k_cache.index_select(1, blocks).view(kv_heads * n, length, d)
        values = self.v_cache.index_select(1, blocks).view(kv_heads * n, length, d)
        queries = q[:n] if batch.are_prefix else q.index_select(0, batch.token_idx)
        queries = queries.view(n, kv_heads, group, d).transpose(0, 1).reshape(kv_heads * n, group, d)
        bias = self._decode_bias(batch, group, q.dtype)
        if self.softcap is None:
            scores = torch.baddbmm(bias, queries, keys.transpose(1, 2), alpha=self.scale)
        else:
            scores = torch.bmm(queries, keys.transpose(1, 2)).mul_(self.scale).div_(self.softcap).tanh_().mul_(self.softcap)
            scores.add_(bias)
        if self.sinks is not None:  # head kv * group + g of query row (kv, n, g)
            sinks = self.sinks.to(scores.dtype).view(kv_heads, 1, group, 1).expand(kv_heads, n, group, 1)
            probs = torch.softmax(torch.cat([scores, sinks.reshape(kv_heads * n, group, 1)], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        attn = torch.bmm(probs, values)
        attn = attn.view(kv_heads, n, group, d).transpose(0, 1).reshape(n, self.num_heads, d)
        if batch.are_prefix:
            out[:n] = attn
        else:
            out.index_copy_(0, batch.token_idx, attn)

    def _decode_bias(self, batch: DecodeBatch, group: int, dtype: torch.dtype) -> torch.Tensor:
        """The length mask (and window) as [kv_heads * num_decodes, group, max_len], built once per step."""
        key = (self.num_kv_heads, group, dtype, self.sliding_window)
        bias = batch.bias_cache.get(key)
        if bias is None:
            _, mask, length = batch.gather
            n = len(batch.rows)
            if self.sliding_window is not None:
                first = torch.from_numpy(batch.seq_lens.astype(np.int64) - self.sliding_window).to(mask.device)
                outside = torch.arange(length, device=mask.device)[None, None, :] < first[:, None, None]
                mask = mask.masked_fill(outside, float("-inf"))
            bias = mask.to(dtype).expand(self.num_kv_heads, n, group, length)
            bias = batch.bias_cache[key] = bias.reshape(self.num_kv_heads * n, group, length)
        return bias

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_flat: Optional[torch.Tensor],
        v_flat: Optional[torch.Tensor],
        seq: PrefillSeq,
    ) -> torch.Tensor:
        queries = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
        if seq.context_slots is None:
            keys = k[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            values = v[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
        else:
            if k_flat is None or v_flat is None:
                raise RuntimeError("a prefill after a cached prefix needs the KV cache.")
            keys = k_flat.index_select(1, seq.context_slots).unsqueeze(0)
            values = v_flat.index_select(1, seq.context_slots).unsqueeze(0)
        mask = seq.mask
        if self.sliding_window is not None and seq.num_computed + seq.end - seq.start > self.sliding_window:
            mask = seq.window_mask(self.sliding_window, q.device, self.causal)
        if self.softcap is not None or self.sinks is not None:
            if mask is None:  # a window as long as the sequence: plain causal, or everything
                mask = seq.window_mask(keys.shape[2], q.device, self.causal)
            attn = self._eager(queries, keys, values, mask)
        elif mask is None:
            attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=self.causal, scale=self.scale, enable_gqa=True)
        else:
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return attn.squeeze(0).transpose(0, 1)

    def _eager(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Eager attention (SDPA has neither): scores capped before the mask, sink logits joining the softmax."""
        group = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.matmul(queries, keys.transpose(2, 3)).mul_(self.scale)
        if self.softcap is not None:
            scores.div_(self.softcap).tanh_().mul_(self.softcap)
        scores.masked_fill_(~mask, float("-inf"))
        if self.sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        else:
            sinks = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        return torch.matmul(probs.to(queries.dtype), values)
