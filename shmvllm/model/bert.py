"""Native BERT / RoBERTa / XLM-RoBERTa encoder over packed sequences (no padding anywhere).

The batch is one flat run of tokens, all sequences concatenated, described by `cu_seqlens`
(cumulative lengths, `[0, len0, len0+len1, ...]`). Every matmul of the model therefore works on
real tokens only; attention alone is per sequence (bidirectional, no mask needed inside one).

Weights come from a Hugging Face `BertModel` / `RobertaModel` / `XLMRobertaModel` directory
(config.json + safetensors), with or without the `bert.` / `roberta.` prefix that `*For*`
checkpoints carry; a classification head's tensors are taken out before (model/classifier.py),
the pooler and LM heads are ignored. RoBERTa and XLM-RoBERTa are BERT with position ids counted
from padding_idx + 1 and (usually) one token type.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shmvllm.model.encoder_gemm import PackedLinear, pack_for_cpu, token_wise

_IGNORED_PREFIXES = ("pooler.", "cls.", "lm_head.")
_MODEL_PREFIXES = ("bert.", "roberta.")
# RoBERTa's position ids start after padding_idx (its own pad token's position).
_OFFSET_POSITION_TYPES = ("roberta", "xlm-roberta")
_IGNORED_SUFFIXES = ("position_ids",)


class BertEmbeddings(nn.Module):
    """word + absolute position + token type embeddings, then LayerNorm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = config.pad_token_id + 1 if config.model_type in _OFFSET_POSITION_TYPES else 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: Optional[torch.Tensor]
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        x += self.position_embeddings(positions + self.position_offset if self.position_offset else positions)
        if token_type_ids is None:  # all zeros: one broadcast row instead of a gather
            x += self.token_type_embeddings.weight[0]
        else:
            x += self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    """Post-LayerNorm transformer block with a fused QKV projection.

    The softmax scale 1/sqrt(head_dim) is folded into the query weights at load time
    (`fold_query_scale`), which saves one elementwise pass over Q per layer.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        if hidden % config.num_attention_heads:
            raise ValueError(
                f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({config.num_attention_heads})."
            )
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.out = nn.Linear(config.intermediate_size, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        if config.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported by the BERT encoder.")
        self.gelu_approximate = "none" if config.hidden_act == "gelu" else "tanh"
        self.packed: dict[str, PackedLinear] = {}  # linear name -> its AVX2-GEMM copy (pack_linears)
        self.hidden = hidden

    @torch.no_grad()
    def fold_query_scale(self) -> None:
        hidden = self.num_heads * self.head_dim
        scale = self.head_dim**-0.5
        self.qkv.weight[:hidden] *= scale
        self.qkv.bias[:hidden] *= scale

    def pack_linears(self, split_qkv: bool = False) -> None:
        """Packs the linears for the AVX2 GEMM where it is the one to use (model/encoder_gemm.py);
        split_qkv: Q and KV apart too, for forward's query_at (the last layer's)."""
        names = ("qkv", "attn_out", "intermediate", "out", *(("q", "kv") if split_qkv else ()))
        for name in names:
            linear = self._weights(name)
            packed = pack_for_cpu(linear.weight, linear.bias)
            if packed is not None:
                self.packed[name] = packed

    def _weights(self, name: str) -> Any:
        """The linear `name`: a layer's own, or "q" / "kv", the fused QKV's rows for Q / K and V."""
        if name == "q":
            return _Rows(self.qkv.weight[: self.hidden], self.qkv.bias[: self.hidden])
        if name == "kv":
            return _Rows(self.qkv.weight[self.hidden :], self.qkv.bias[self.hidden :])
        return getattr(self, name)

    def _linear(
        self, x: torch.Tensor, name: str, residual: Optional[torch.Tensor] = None, gelu: Optional[str] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The linear `name` of x, + residual or GELU; `out`: where the C kernel may write it
        (torch's linears return a new tensor instead of copying theirs there)."""
        packed = self.packed.get(name)
        if packed is not None:
            return packed(x, residual, gelu, out)
        return _linear(x, self._weights(name), residual, gelu)

    def forward(
        self, x: torch.Tensor, plan: AttentionPlan, scratch: Scratch, query_at: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The layer's output, written over x (each row is read, as the residual, before it is
        written), or, with query_at (see AttentionPlan.attend_one), a new tensor for those tokens
        only, one per sequence: their queries alone are projected, every token's keys and values."""
        if query_at is None:
            qkv = self._linear(x, "qkv", out=scratch.get("qkv", x.shape[0], 3 * self.hidden, x))
            attn = plan.attend(qkv, self.num_heads, self.head_dim)
        else:
            kv = self._linear(x, "kv", out=scratch.get("qkv", x.shape[0], 2 * self.hidden, x))
            x = x.index_select(0, plan.token_rows(query_at))
            attn = plan.attend_one(self._linear(x, "q"), kv, self.num_heads, self.head_dim, query_at)
        packed = [self.packed.get(name) for name in ("attn_out", "intermediate", "out")]
        if all(packed):  # the whole token-wise half in one call of the C kernel, a block of rows at a time
            o, up, down = packed
            return token_wise(attn, x, o, self.attn_norm, up, self.gelu_approximate, down, self.out_norm, x)
        for start in range(0, x.shape[0], TOKEN_CHUNK):
            rows = x[start : start + TOKEN_CHUNK]
            rows.copy_(self._token_wise(attn[start : start + TOKEN_CHUNK], rows))
        return x

    def _token_wise(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Everything after attention: output projection, norms and the MLP, row by row."""
        x = self.attn_norm(self._linear(attn, "attn_out", residual=residual))
        h = self._linear(x, "intermediate", gelu=self.gelu_approximate)
        return self.out_norm(self._linear(h, "out", residual=x))


class Scratch:
    """Activations a forward overwrites layer after layer (the QKV projection's), kept between
    forwards: fresh tensors of this size were page-faulted anew by every layer of every step."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, cols] tensor of like's dtype and device, valid until the next get(name)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < rows * cols or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = like.new_empty(rows * cols)
            self._buffers[name] = buffer
        return buffer[: rows * cols].view(rows, cols)


class _Rows(NamedTuple):
    """Some output rows of a linear (views of its weight and bias), used as the linear itself."""

    weight: torch.Tensor
    bias: torch.Tensor


TOKEN_CHUNK = 2048
"""Off the C kernel, the token-wise half of a layer runs on chunks of this many tokens, so that
the wide MLP activation stays in cache (benchmarks/results/embed.md, "Encoder choices")."""


def _linear(
    x: torch.Tensor, layer: nn.Linear | _Rows, residual: Optional[torch.Tensor] = None, gelu: Optional[str] = None
) -> torch.Tensor:
    """x @ W^T + b, then + residual, or GELU (`gelu` names its approximation: "none" is the
    exact erf form, "tanh" the tanh one; None means no GELU), fused into the GEMM by oneDNN on
    the CPU, which beats separate GELU and add passes (benchmarks/results/embed.md)."""
    if x.device.type == "cpu" and _ONEDNN_FUSION:
        if residual is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, layer.weight, layer.bias, "add")
        attr = "none" if gelu is None else "gelu"
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, attr, [], gelu or "none")
    y = F.linear(x, layer.weight, layer.bias)
    if residual is not None:
        return y.add_(residual)
    return y if gelu is None else F.gelu(y, approximate=gelu)


_ONEDNN_FUSION = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class AttentionPlan:
    """How one packed batch is attended. On an x86 CPU in fp32 (head_dim a multiple of 8):
    kernels/encoder_attention.c, one task per (sequence, head) over each sequence's own tokens,
    reading the packed QKV in place. Elsewhere: each run of consecutive sequences of equal length
    is a zero-copy [count, length, 3, heads, head_dim] view of the packed QKV, attended by one
    SDPA call without a mask (callers get the fewest runs by packing sequences sorted by
    length), the fastest torch layout measured (benchmarks/results/embed.md, "Encoder choices").
    Built once per forward, used by every layer."""

    def __init__(self, cu_seqlens: list[int]) -> None:
        self.cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
        self.runs: list[tuple[int, int, int, int]] = []  # (first token, first sequence, number of sequences, length)
        for seq, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
            length = end - start
            if self.runs and self.runs[-1][3] == length:
                first, first_seq, count, _ = self.runs[-1]
                self.runs[-1] = (first, first_seq, count + 1, length)
            else:
                self.runs.append((start, seq, 1, length))

    def token_rows(self, query_at: torch.Tensor) -> torch.Tensor:
        """The packed rows of the tokens `query_at` names (one offset per sequence)."""
        return self.cu_seqlens[:-1].to(query_at.device) + query_at

    def attend(self, qkv: torch.Tensor, num_heads: int, head_dim: int, window: Optional[int] = None) -> torch.Tensor:
        """qkv: [num_tokens, 3 * hidden] (Q pre-scaled) -> [num_tokens, hidden].
        window: each token attends only to those at most this many positions away (ModernBERT's
        local layers); a run no longer than window + 1 needs no mask."""
        hidden = num_heads * head_dim
        return self._attend(qkv[:, :hidden], qkv[:, hidden:], num_heads, head_dim, window, None)

    def attend_one(
        self, q: torch.Tensor, kv: torch.Tensor, num_heads: int, head_dim: int, query_at: torch.Tensor, window: Optional[int] = None
    ) -> torch.Tensor:
        """One query per sequence, what a pooler reading one token needs: q [num_seqs, hidden]
        (pre-scaled), the queries of the tokens at offsets query_at [num_seqs] (int64); kv:
        [num_tokens, 2 * hidden], every token's key and value -> [num_seqs, hidden]."""
        return self._attend(q, kv, num_heads, head_dim, window, query_at)

    def _attend(
        self, q: torch.Tensor, kv: torch.Tensor, num_heads: int, head_dim: int, window: Optional[int], query_at: Optional[torch.Tensor]
    ) -> torch.Tensor:
        out = q.new_empty(q.shape[0], num_heads * head_dim)
        lib = _attention_kernels(q, kv, head_dim)
        if lib is not None:
            query_ptr = None
            if query_at is not None:
                query_at = query_at.to(device="cpu", dtype=torch.int64).contiguous()
                query_ptr = query_at.data_ptr()
            if lib.shm_encoder_attention(
                q.data_ptr(), q.stride(0), kv.data_ptr(), kv.stride(0), self.cu_seqlens.data_ptr(), len(self.cu_seqlens) - 1,
                num_heads, head_dim, -1 if window is None else window, out.data_ptr(), out.stride(0), query_ptr,
            ):
                raise MemoryError("encoder attention: out of memory for its per-thread buffers.")
            return out
        # Each run's [count, heads, queries, head_dim] result is copied once, straight into its
        # rows of the output (a reshape then a cat would copy it twice).
        for first, first_seq, count, length in self.runs:
            k, v = kv[first : first + count * length].view(count, length, 2, num_heads, head_dim).permute(2, 0, 3, 1, 4)
            offsets = torch.arange(length, device=q.device)
            if query_at is None:
                rows = out[first : first + count * length]
                queries = offsets[None, :]  # [1, length]: each query's position
                run_q = q[first : first + count * length]
            else:
                rows = out[first_seq : first_seq + count]
                queries = query_at[first_seq : first_seq + count, None].to(q.device)  # [count, 1]
                run_q = q[first_seq : first_seq + count]
            mask = None
            if window is not None and length > window + 1:
                mask = ((queries[:, :, None] - offsets).abs() <= window)[:, None]
            run_q = run_q.view(count, -1, num_heads, head_dim).transpose(1, 2)
            result = F.scaled_dot_product_attention(run_q, k, v, attn_mask=mask, scale=1.0)
            rows.view(count, -1, num_heads, head_dim).copy_(result.transpose(1, 2))
        return out


def _attention_kernels(q: torch.Tensor, kv: torch.Tensor, head_dim: int) -> Optional[Any]:
    """encoder_attention.c's library where it applies to these Q and KV rows, else None (SDPA)."""
    for t in (q, kv):
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.stride(1) != 1:
            return None
    if head_dim % 8:
        return None
    from shmvllm.model.kernels import encoder_attention_kernels

    return encoder_attention_kernels()


class BertModel(nn.Module):
    """Returns the last hidden state of every packed token: [num_tokens, hidden_size], or of one
    token per sequence (`query_at`): [num_seqs, hidden_size]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.scratch = Scratch()

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: list[int],
        token_type_ids: Optional[torch.Tensor] = None,
        query_at: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """input_ids, positions (and token_type_ids): [num_tokens]; cu_seqlens: len = num_seqs + 1.
        query_at: [num_seqs] int64, the offset of the one token each sequence's pooler reads: the
        last layer then computes keys and values for every token, all else for those only."""
        plan = AttentionPlan(cu_seqlens)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers[:-1]:
            x = layer(x, plan, self.scratch)
        return self.layers[-1](x, plan, self.scratch, query_at)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads HF BertModel / RobertaModel tensors (names with or without `bert.` / `roberta.`)
        and fuses Q, K and V."""
        weights = _strip_hf_names(state_dict)
        own: dict[str, torch.Tensor] = {}
        for name in list(weights):
            if not name.startswith("encoder.layer."):
                own[name] = weights.pop(name)
        for i in range(self.config.num_hidden_layers):
            own.update(_layer_weights(weights, f"encoder.layer.{i}.", f"layers.{i}."))
        if weights:
            raise ValueError(f"unexpected BERT weights: {sorted(weights)[:5]}")
        missing, unexpected = self.load_state_dict(own, strict=False)
        if missing or unexpected:
            raise ValueError(f"BERT weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for layer in self.layers:
            layer.fold_query_scale()

    def pack_linears(self) -> None:
        """Call once the weights are loaded and on their device and dtype."""
        for layer in self.layers:
            layer.pack_linears(split_qkv=layer is self.layers[-1])


def _strip_hf_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state_dict.items():
        for prefix in _MODEL_PREFIXES:
            name = name.removeprefix(prefix)
        if name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES):
            continue
        out[name] = tensor
    return out


def _layer_weights(weights: dict[str, torch.Tensor], hf: str, own: str) -> dict[str, torch.Tensor]:
    """Pops one HF encoder layer's tensors from `weights`, renamed to BertLayer's names."""
    qkv = [f"{hf}attention.self.{p}" for p in ("query", "key", "value")]
    renames = {
        "attention.output.dense": "attn_out",
        "attention.output.LayerNorm": "attn_norm",
        "intermediate.dense": "intermediate",
        "output.dense": "out",
        "output.LayerNorm": "out_norm",
    }
    out = {}
    for kind in ("weight", "bias"):
        out[f"{own}qkv.{kind}"] = torch.cat([weights.pop(f"{p}.{kind}") for p in qkv])
        for hf_name, own_name in renames.items():
            out[f"{own}{own_name}.{kind}"] = weights.pop(f"{hf}{hf_name}.{kind}")
    return out
