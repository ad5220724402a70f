"""Tiny seeded models of any decoder family, for tests: built with transformers' own config and
model classes, saved as an HF directory, and the same weights written as a GGUF file with the
`gguf` package; plus transformers' eager fp32 greedy reference with its top-2 margins.

    model_dir = build_tiny("gemma3", tmp_path / "gemma3")          # HF directory
    gguf_path = write_gguf(model_dir, tmp_path / "gemma3.gguf")     # same weights, GGUF (F32)
    expected = hf_greedy(model_dir, prompt, max_tokens=8)            # (tokens, top-2 margins)

Families are declared in TINY_CONFIGS (a transformers config class name and its small sizes);
a new family is one entry there (and, for GGUF, its name map in GGUF_NAMES when it is not the
llama one). Weights are drawn N(0, 0.08) for matrices (peaked logits: top-2 margins of ~0.1-1),
norm weights around their neutral value, so that a norm loaded in the wrong place shows.

The tokenizer: a synthetic byte-level vocabulary (`VOCAB` tokens) written into the GGUF file as
a llama-style (sentencepiece) vocabulary, and into the HF directory as the tokenizer transformers
makes from that file, so that both load the same way.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB = 512
MARGIN = 1e-3  # a divergence is forgiven only where transformers' top-2 logit margin is below this

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
    bos_token_id=2, eos_token_id=1, pad_token_id=0,
)

TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True)),
    # head_dim 128: transformers' qwen3 GGUF config takes no key_length, so its files get the default
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=128)),
    # the Gemmas keep the config defaults that transformers' GGUF loader does not read from a file
    # (query_pre_attn_scalar, soft-capping, Gemma 3's layer pattern of 5 sliding + 1 global and
    # its two rope bases), so that the GGUF file's reference is the same model
    "gemma2": ("Gemma2Config", dict(tie_word_embeddings=True, sliding_window=8)),
    "gemma3": ("Gemma3TextConfig", dict(tie_word_embeddings=True, sliding_window=8, num_hidden_layers=6)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False)),
    "granite": ("GraniteConfig", dict(tie_word_embeddings=True)),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False)),
    "smollm3": ("SmolLM3Config", dict(tie_word_embeddings=True)),
    # mixtures of experts: 8 experts, top-2; Qwen3-MoE's layer 1 a dense MLP (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2)),
    # gpt-oss: sliding and full layers, YaRN stretching 32 positions by 32 (truncate False, as gpt-oss ships)
    "gpt_oss": ("GptOssConfig", dict(tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
                                     intermediate_size=64, sliding_window=8, rope_parameters=dict(
                                         rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                         original_max_position_embeddings=32, truncate=False))),
}

# GGUF architecture of each family and its layer tensor names (llama.cpp's), as the converter writes them
GGUF_ARCH = {"llama": "llama", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe",
             "mixtral": "llama", "gpt_oss": "gpt-oss"}  # llama.cpp writes Mixtral as a llama with experts
_LLAMA_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    # mixtures of experts: the router, and each projection's experts stacked [n_expert, rows, k]
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
_GEMMA_NAMES = {
    **_LLAMA_NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_PHI3_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GPT_OSS_NAMES = {**_LLAMA_NAMES, "post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks"}
GGUF_NAMES = {
    "llama": _LLAMA_NAMES, "qwen3": _LLAMA_NAMES, "gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES, "phi3": _PHI3_NAMES,
    "qwen3_moe": _LLAMA_NAMES, "mixtral": _LLAMA_NAMES, "gpt_oss": _GPT_OSS_NAMES,
}
# Mixtral's checkpoint names in llama.cpp's converter's terms (it stacks the experts as Qwen3-MoE's)
_MIXTRAL_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def tiny_config(family: str, **overrides: Any) -> Any:
    import transformers

    class_name, extra = TINY_CONFIGS[family]
    return getattr(transformers, class_name)(**{**_COMMON, **extra, **overrides})


def build_tiny(family: str, target: Path, seed: int = 0, **overrides: Any) -> Path:
    """A small (2-layer; Gemma 3: 6) seeded model of `family` saved (fp32 safetensors) with a tokenizer in `target`."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif name.endswith(("bias", "sinks")):  # biases and gpt-oss's sink logits around 0
                p.normal_(0.0, 0.1)
            else:  # norms: Gemma's (1 + w) weights around 0, the others around 1
                p.normal_(0.0 if family.startswith("gemma") else 1.0, 0.1)
    model.eval()
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    _tokenizer(target)
    return target


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """A sentencepiece-style vocabulary: specials, the 256 byte tokens, then word pieces."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = [f"\u2581{a}{b}" for a in letters for b in letters][: VOCAB - len(specials) - len(pieces)]
    tokens = specials + pieces + words
    scores = [0.0] * len(specials) + [0.0] * len(pieces) + [-float(i) for i in range(len(words))]
    types = [3, 3, 3, 2] + [6] * len(pieces) + [1] * len(words)  # control, unknown, byte, normal
    return tokens, scores, types


def _write_vocab(writer: Any) -> None:
    tokens, scores, types = _vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(_COMMON["bos_token_id"])
    writer.add_eos_token_id(_COMMON["eos_token_id"])
    writer.add_pad_token_id(_COMMON["pad_token_id"])
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)


def _tokenizer(target: Path) -> None:
    """The tokenizer transformers makes of the synthetic vocabulary, saved into `target`."""
    from transformers import AutoTokenizer

    path = target / "vocab-only.gguf"
    _write_gguf_file(path, "llama", {}, lambda writer: None)
    try:
        AutoTokenizer.from_pretrained(target, gguf_file=path.name).save_pretrained(target)
    finally:
        path.unlink()


def _write_gguf_file(path: Path, arch: str, metadata: dict[str, Any], add_tensors: Any) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        getattr(writer, key)(value)
    _write_vocab(writer)
    add_tensors(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleave of q/k rows (what transformers undoes for llama files)."""
    rows = weights.shape[0]
    return weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_gguf(model_dir: Path, path: Path, qtype: str = "F32") -> Path:
    """The HF directory's weights as a GGUF file with llama.cpp's names and conventions (q/k rows
    interleaved for llama, Gemma's norms stored as 1 + w) and the config's metadata; matrices
    in `qtype` (F32, or a GGML block format gguf.quants can quantize, e.g. Q8_0), norms in F32."""
    import gguf

    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    family = next(f for f, (cls, _) in TINY_CONFIGS.items() if type(config).__name__ == cls)
    arch, names = GGUF_ARCH[family], GGUF_NAMES[family]
    state = load_file(str(model_dir / "model.safetensors"))
    metadata = {
        "add_context_length": config.max_position_embeddings, "add_embedding_length": config.hidden_size,
        "add_block_count": config.num_hidden_layers, "add_feed_forward_length": config.intermediate_size,
        "add_head_count": config.num_attention_heads, "add_head_count_kv": config.num_key_value_heads,
        "add_layer_norm_rms_eps": config.rms_norm_eps, "add_key_length": config.head_dim,
        "add_value_length": config.head_dim, "add_vocab_size": config.vocab_size,
    }
    rope = config.rope_parameters
    metadata["add_rope_freq_base"] = float((rope.get("full_attention") or rope)["rope_theta"])
    if getattr(config, "sliding_window", None) is not None and family.startswith("gemma"):
        metadata["add_sliding_window"] = config.sliding_window
    if family == "qwen3_moe":
        metadata.update(add_expert_count=config.num_experts, add_expert_used_count=config.num_experts_per_tok,
                        add_expert_feed_forward_length=config.moe_intermediate_size)
        state = _stack_experts(state, config.num_experts)
    if family == "mixtral":
        metadata.update(add_expert_count=config.num_local_experts, add_expert_used_count=config.num_experts_per_tok)
        for old, new in _MIXTRAL_RENAMES:
            state = {name.replace(old, new): tensor for name, tensor in state.items()}
        state = _stack_experts(state, config.num_local_experts)

    if family == "gpt_oss":
        metadata.update(add_expert_count=config.num_local_experts, add_expert_used_count=config.num_experts_per_tok,
                        add_expert_feed_forward_length=config.intermediate_size, add_sliding_window=config.sliding_window,
                        add_rope_scaling_type=gguf.RopeScalingType.YARN, add_rope_scaling_factor=float(rope["factor"]),
                        add_rope_scaling_orig_ctx_len=int(rope["original_max_position_embeddings"]))
        state = _gpt_oss_as_llama_cpp(state)

    def add_tensors(writer: Any) -> None:
        for name, tensor in state.items():
            values = tensor.float().numpy()
            if name == "model.embed_tokens.weight":
                gguf_name = "token_embd.weight"
            elif name == "model.norm.weight":
                gguf_name = "output_norm.weight"
            elif name == "lm_head.weight":
                gguf_name = "output.weight"
            else:
                _, _, layer, rest = name.split(".", 3)
                local, _, suffix = rest.rpartition(".")
                gguf_name = f"blk.{layer}.{names[local]}.{suffix}"
                if arch == "llama" and local == "self_attn.q_proj":
                    values = _permute(values, config.num_attention_heads)
                elif arch == "llama" and local == "self_attn.k_proj":
                    values = _permute(values, config.num_key_value_heads)
            if family.startswith("gemma") and gguf_name.endswith("norm.weight"):
                values = values + np.float32(1.0)
            values = np.ascontiguousarray(values, dtype=np.float32)
            # llama.cpp keeps the router F32; gpt-oss's files hold the experts' weights alone in MXFP4
            if (values.ndim >= 2 and qtype != "F32" and "ffn_gate_inp" not in gguf_name
                    and (family != "gpt_oss" or "_exps.weight" in gguf_name)):
                kind = gguf.GGMLQuantizationType[qtype]
                writer.add_tensor(gguf_name, gguf.quants.quantize(values, kind), raw_dtype=kind)
            else:
                writer.add_tensor(gguf_name, values)

    _write_gguf_file(path, arch, metadata, add_tensors)
    return path


def _gpt_oss_as_llama_cpp(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's stacked experts as llama.cpp's converter writes them: gate_up_proj [E, hidden,
    2I] (gate and up interleaved) -> gate_proj / up_proj [E, I, hidden], down_proj [E, I, hidden]
    -> [E, hidden, I], biases split the same way; the router as mlp.gate, the sinks as a weight."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        stem, _, leaf = name.rpartition(".mlp.experts.")
        if leaf == "gate_up_proj":
            out[f"{stem}.mlp.experts.gate_proj.weight"] = tensor.transpose(1, 2)[:, ::2]
            out[f"{stem}.mlp.experts.up_proj.weight"] = tensor.transpose(1, 2)[:, 1::2]
        elif leaf == "gate_up_proj_bias":
            out[f"{stem}.mlp.experts.gate_proj.bias"] = tensor[:, ::2]
            out[f"{stem}.mlp.experts.up_proj.bias"] = tensor[:, 1::2]
        elif leaf == "down_proj":
            out[f"{stem}.mlp.experts.down_proj.weight"] = tensor.transpose(1, 2)
        elif leaf == "down_proj_bias":
            out[f"{stem}.mlp.experts.down_proj.bias"] = tensor
        elif name.endswith(".self_attn.sinks"):
            out[name + ".weight"] = tensor
        else:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = tensor
    return out


def quantized_copy(model_dir: Path, target: Path, qtype: str) -> Path:
    """The HF directory with every matrix that write_gguf quantizes (all but the router) replaced by
    its `qtype` blocks' dequantized values: the weights a GGUF file of that qtype holds, for
    transformers to run where its GGUF loader cannot read the file (Mixtral's, gpt-oss's MXFP4)."""
    import shutil

    import gguf
    from safetensors.torch import load_file, save_file

    kind = gguf.GGMLQuantizationType[qtype]
    state = load_file(str(model_dir / "model.safetensors"))
    experts_only = json.loads((model_dir / "config.json").read_text())["model_type"] == "gpt_oss"  # as write_gguf
    for name, tensor in state.items():
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):  # gpt-oss: x @ W, blocks along W^T's rows
            values = gguf.quants.dequantize(gguf.quants.quantize(tensor.transpose(1, 2).float().contiguous().numpy(), kind), kind)
            state[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).transpose(1, 2).contiguous()
        elif experts_only:
            continue
        elif tensor.dim() >= 2 and not name.endswith(".gate.weight"):  # the router stays F32
            values = gguf.quants.dequantize(gguf.quants.quantize(tensor.float().numpy(), kind), kind)
            state[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(tensor.shape)
    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _stack_experts(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Each layer's per-expert tensors (mlp.experts.E.gate_proj.weight) stacked into one
    [n_expert, rows, k] tensor named mlp.experts.gate_proj.weight, as llama.cpp stores them."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".mlp.experts." not in name:
            out[name] = tensor
        elif ".mlp.experts.0." in name:
            stem, rest = name.split(".mlp.experts.0.")
            out[f"{stem}.mlp.experts.{rest}"] = torch.stack([state[f"{stem}.mlp.experts.{e}.{rest}"] for e in range(num_experts)])
    return out


@functools.lru_cache(maxsize=None)
def hf_model(model_dir: Path, gguf_file: str | None = None, overrides: tuple[tuple[str, Any], ...] = ()) -> Any:
    """transformers' eager fp32 model of an HF directory (or of a GGUF file in it); `overrides`:
    config values its GGUF loader does not read from a file."""
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file, **dict(overrides)} if gguf_file else dict(overrides)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()


@functools.lru_cache(maxsize=None)
def hf_greedy(model_dir: Path, prompt: tuple[int, ...], max_tokens: int, gguf_file: str | None = None,
              overrides: tuple[tuple[str, Any], ...] = ()) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (it stops after EOS, which it keeps) and, per generated
    token, the margin between its top-2 logits."""
    model = hf_model(model_dir, gguf_file, overrides)
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos,
            output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for logits in out.logits:
        top = torch.topk(logits[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return tokens, margins


def assert_same_greedy(got: list[int], expected: tuple[list[int], list[float]], what: str = "") -> None:
    """Equal tokens, or a first divergence where transformers' own top-2 margin is below MARGIN
    (then the rest is not compared: the two continue from different tokens)."""
    tokens, margins = expected
    for i, (a, b) in enumerate(zip(got, tokens)):
        if a != b:
            assert margins[i] < MARGIN, f"{what}: token {i} is {a}, transformers' {b} (its top-2 margin {margins[i]:.4g})"
            return
    assert len(got) == len(tokens), f"{what}: {len(got)} tokens, transformers gave {len(tokens)}: {got} vs {tokens}"
