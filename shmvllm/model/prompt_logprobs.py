"""Prompt logprobs: for every prompt position of a step, the logprob and rank of the next prompt
token and the top-k, over the whole vocabulary.

One long prompt asks this for thousands of rows at once (8k rows x 49k logits is 1.6 GB of
fp32 per temporary). On the CPU the rows go in blocks of BLOCK_ROWS: each block's logits stay in
cache between the lm_head and the reductions, no temporary grows with the prompt, and a block's
reductions are one call of the fused kernel (kernels/logprobs.c). Without a compiler, for a
top-k wider than the kernel keeps, or on another device (in one block there), they are torch's
log_softmax and `gather_logprobs`, which the kernel is tested against.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np
import torch

from shmvllm.model.kernels import logprob_kernels
from shmvllm.model.sampler import gather_logprobs

BLOCK_ROWS = 64
"""Rows per lm_head call: 64 x 49k fp32 logits is 12 MiB, in the L3 cache the kernel reads them
from, and a block the allocator reuses (a 2048-row step's whole logits were 400 MB, mapped
afresh, page by page, in every step)."""

MAX_FUSED_TOP = 64
"""Widest top-k the fused kernel selects (it keeps the top in a sorted list); wider goes to torch.topk."""


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, num_top: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """hidden: [rows, hidden_size] states of the positions; targets: [rows] int64 next tokens.
    Returns int32 token ids and float32 logprobs [rows, 1 + num_top] (the target, then the top
    num_top), and int32 ranks [rows] (1 = most likely) of the targets."""
    rows = hidden.shape[0]
    ids = np.empty((rows, 1 + num_top), dtype="<i4")
    lps = np.empty((rows, 1 + num_top), dtype="<f4")
    ranks = np.empty(rows, dtype="<i4")
    on_cpu = hidden.device.type == "cpu"
    fused = _FusedReductions(num_top) if on_cpu and num_top <= MAX_FUSED_TOP else None
    block_rows = BLOCK_ROWS if on_cpu else max(rows, 1)  # elsewhere (untuned) one block, as before
    for start in range(0, rows, block_rows):
        end = min(start + block_rows, rows)
        logits = compute_logits(hidden[start:end])
        if fused is not None and fused.lib is not None and logits.dtype == torch.float32:
            fused(logits, targets[start:end], ids[start:end], lps[start:end], ranks[start:end])
            continue
        block = gather_logprobs(torch.log_softmax(logits, dim=-1), targets[start:end], num_top)
        for out, value in zip((ids, lps, ranks), block):
            out[start:end] = value.cpu().numpy()
    return ids, lps, ranks


class _FusedReductions:
    """One block's reductions in kernels/logprobs.c, writing straight into the output arrays."""

    def __init__(self, num_top: int) -> None:
        self.lib = logprob_kernels()
        self.num_top = num_top
        self.threads = torch.get_num_threads()
        self.scratch_values = np.empty(self.threads * max(num_top, 1), dtype=np.float32)
        self.scratch_ids = np.empty(self.threads * max(num_top, 1), dtype=np.int64)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, ids: np.ndarray, lps: np.ndarray,
                 ranks: np.ndarray) -> None:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        targets = targets.to(torch.int64).contiguous()
        rows, vocab = logits.shape
        status = self.lib.shm_logprob_rows(
            logits.data_ptr(), rows, vocab, logits.stride(0), targets.data_ptr(), self.num_top, max(self.num_top, 1),
            _address(ids), _address(lps), _address(ranks),
            _address(self.scratch_values), _address(self.scratch_ids), self.threads,
        )
        if status != 0:
            raise ValueError(
                f"prompt logprobs: a target token id outside [0, {vocab}) or top-k {self.num_top} out of range "
                f"(targets {targets.min().item()}..{targets.max().item()})."
            )


def _address(array: np.ndarray) -> int:
    return array.ctypes.data_as(ctypes.c_void_p).value
