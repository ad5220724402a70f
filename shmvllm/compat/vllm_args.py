"""vLLM's engine arguments that shmvllm has no knob of its own for: each is either accepted at
any value because it makes no difference here (IGNORED), or accepted only at the values that ask
for nothing shmvllm lacks (ONLY), and otherwise refused with a ValueError naming it.

`VllmArgs` makes each one a keyword-only dataclass field with vLLM's default, and EngineArgs
derives from it, so that `LLM(**vars(parser.parse_args()))` after `EngineArgs.add_cli_args`, and
`LLM(**dataclasses.asdict(EngineArgs(...)))`, take vLLM's full argument list. The arguments
shmvllm implements (dtype, max_model_len, runner, kv_cache_memory_bytes, ...) are EngineArgs'
own fields, not listed here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class VllmArg:
    name: str
    default: Any
    why: str
    allowed: Optional[tuple] = None  # None: IGNORED (any value); else the values accepted
    cli_type: Optional[Callable[[str], Any]] = None  # how `add_cli_args` parses it (bool: --x / --no-x;
    # None: JSON when it looks like JSON, else the text)

    @property
    def ignored(self) -> bool:
        return self.allowed is None


def _ignored(name: str, default: Any, why: str, cli_type: Optional[Callable[[str], Any]] = None) -> VllmArg:
    return VllmArg(name, default, why, None, cli_type)


def _only(name: str, default: Any, why: str, *more: Any, cli_type: Optional[Callable[[str], Any]] = None) -> VllmArg:
    return VllmArg(name, default, why, (default, *more), cli_type)


_NO_CUDA_GRAPHS = "shmvllm runs the model eagerly and compiles nothing (no CUDA graphs, no torch.compile)"
_ONE_NODE = "shmvllm's data-parallel engines are all started and routed by one LLM on one machine (data_parallel_size=N)"
_CPU_TP = "shmvllm's parallelism is data_parallel_size engines, and tensor_parallel_size ranks or pipeline_parallel_size stages per engine, on one machine"
_NO_DOWNLOAD = "shmvllm loads local models only and downloads nothing"
_NO_MM = "shmvllm serves text-only models; this only matters for multimodal ones"
_NO_LORA = "LoRA adapters are not supported (enable_lora=True is refused)"
_EXPERTS_SPLIT = ("shmvllm's tensor parallel splits every expert's intermediate rows over the ranks; "
                  "it has no expert parallelism (whole experts per rank), no expert load balancing and no "
                  "redundant experts")
_NO_MOE = ("tunes expert parallelism or expert load balancing, which shmvllm refuses (enable_expert_parallel, "
           "enable_eplb): its tensor parallel splits every expert's intermediate rows over the CPU ranks of one machine")

VLLM_ARGS: tuple[VllmArg, ...] = (
    # ---- accepted at any value: no effect here ---------------------------------------------
    _ignored("trust_remote_code", False, "shmvllm runs no code from model repositories: its own model "
             "classes load the weights, so no remote code is ever trusted or run", bool),
    _ignored("download_dir", None, _NO_DOWNLOAD),
    _ignored("hf_token", None, _NO_DOWNLOAD),
    _ignored("served_model_name", None, "a name for servers' responses; the offline API has none"),
    _ignored("enforce_eager", False, _NO_CUDA_GRAPHS, bool),
    _ignored("compilation_config", None, _NO_CUDA_GRAPHS),
    _ignored("cuda_graph_sizes", None, _NO_CUDA_GRAPHS),
    _ignored("cudagraph_capture_sizes", None, _NO_CUDA_GRAPHS),
    _ignored("max_cudagraph_capture_size", None, _NO_CUDA_GRAPHS, int),
    _ignored("max_seq_len_to_capture", 8192, _NO_CUDA_GRAPHS, int),
    _ignored("attention_config", None, "shmvllm has one attention implementation per device"),
    _ignored("disable_cascade_attn", False, "shmvllm has no cascade attention", bool),
    _ignored("disable_log_stats", False, "shmvllm always keeps its few counters (LLM.get_metrics)", bool),
    _ignored("aggregate_engine_logging", False, "shmvllm logs no per-engine statistics to aggregate", bool),
    _ignored("disable_log_requests", True, "shmvllm does not log requests", bool),
    _ignored("swap_space", 4, "shmvllm recomputes preempted requests instead of swapping (as vLLM v1)", float),
    _ignored("use_tqdm_on_load", True, "loading shows no progress bar", bool),
    _ignored("safetensors_load_strategy", "lazy", "weights are read the one way the loader has"),
    _ignored("pt_load_map_location", "cpu", "weights load onto the engine's device"),
    _ignored("max_parallel_loading_workers", None, "each rank loads its own share once", int),
    _ignored("disable_custom_all_reduce", False, "tensor-parallel all-reduces are chosen by SHMVLLM_TP_ALLREDUCE (shm or gloo)", bool),
    _ignored("ray_workers_use_nsight", False, "no Nsight profiling of workers: tensor-parallel workers are CPU processes", bool),
    _ignored("prefix_caching_hash_algo", "sha256", "block hashes are internal; results do not depend on them"),
    _ignored("disable_hybrid_kv_cache_manager", False, "shmvllm's models have one KV cache kind", bool),
    _ignored("limit_mm_per_prompt", None, _NO_MM),
    _ignored("media_io_kwargs", None, _NO_MM),
    _ignored("mm_processor_cache_gb", 4, _NO_MM, float),
    _ignored("mm_processor_cache_type", None, _NO_MM),
    _ignored("mm_shm_cache_max_object_size_mb", 128, _NO_MM, int),
    _ignored("mm_encoder_tp_mode", "weights", _NO_MM),
    _ignored("mm_encoder_attn_backend", None, _NO_MM),
    _ignored("disable_mm_preprocessor_cache", False, _NO_MM, bool),
    _ignored("skip_mm_profiling", False, _NO_MM, bool),
    _ignored("video_pruning_rate", 0.0, _NO_MM, float),
    _ignored("allowed_local_media_path", "", _NO_MM),
    _ignored("allowed_media_domains", None, _NO_MM),
    _ignored("disable_chunked_mm_input", False, _NO_MM, bool),
    _ignored("enable_multimodal_encoder_data_parallel", False, _NO_MM, bool),
    _ignored("max_loras", 1, _NO_LORA, int),
    _ignored("max_lora_rank", 16, _NO_LORA, int),
    _ignored("max_cpu_loras", None, _NO_LORA, int),
    _ignored("fully_sharded_loras", False, _NO_LORA, bool),
    _ignored("lora_dtype", "auto", _NO_LORA),
    _ignored("lora_extra_vocab_size", 256, _NO_LORA, int),
    _ignored("default_mm_loras", None, _NO_LORA),
    _ignored("eplb_config", None, _NO_MOE),
    _ignored("eplb_window_size", 1000, _NO_MOE, int),
    _ignored("eplb_step_interval", 3000, _NO_MOE, int),
    _ignored("eplb_log_balancedness", False, _NO_MOE, bool),
    _ignored("expert_placement_strategy", "linear", _NO_MOE),
    _ignored("all2all_backend", None, _NO_MOE),
    _ignored("enable_dbo", False, _NO_MOE, bool),
    _ignored("dbo_decode_token_threshold", 32, _NO_MOE, int),
    _ignored("dbo_prefill_token_threshold", 512, _NO_MOE, int),
    _ignored("disable_nccl_for_dp_synchronization", False, "data-parallel engines synchronize over shared memory, not NCCL", bool),
    _ignored("mamba_cache_dtype", "auto", "shmvllm serves no Mamba models"),
    _ignored("mamba_ssm_cache_dtype", "auto", "shmvllm serves no Mamba models"),
    _ignored("mamba_block_size", None, "shmvllm serves no Mamba models", int),
    _ignored("structured_outputs_config", None, "structured outputs have one backend here"),
    _ignored("guided_decoding_backend", None, "structured outputs have one backend here"),
    _ignored("guided_decoding_disable_fallback", None, "structured outputs have one backend here"),
    _ignored("guided_decoding_disable_any_whitespace", None, "structured outputs have one backend here"),
    _ignored("guided_decoding_disable_additional_properties", None, "structured outputs have one backend here"),
    _ignored("show_hidden_metrics_for_version", None, "shmvllm has no Prometheus endpoint"),
    _ignored("additional_config", None, "platform plugins' settings; shmvllm has no plugins"),
    _ignored("ignore_patterns", None, "which files of a hub download to skip: " + _NO_DOWNLOAD),
    # ---- accepted only at the values listed: anything else asks for what shmvllm lacks ------
    _only("kv_cache_dtype", "auto", "the KV cache has the model's dtype"),
    _only("enable_expert_parallel", False, _EXPERTS_SPLIT, cli_type=bool),
    _only("enable_eplb", False, _EXPERTS_SPLIT, cli_type=bool),
    _only("num_redundant_experts", 0, _EXPERTS_SPLIT, cli_type=int),
    _only("load_format", "auto", "weights load from safetensors or a .gguf file", "safetensors", "gguf"),
    _only("config_format", "auto", "configs are Hugging Face config.json files", "hf"),
    _only("revision", None, _NO_DOWNLOAD),
    _only("code_revision", None, _NO_DOWNLOAD),
    _only("tokenizer_revision", None, _NO_DOWNLOAD),
    _only("hf_config_path", None, "the config is read from the model directory"),
    _only("hf_overrides", None, "the model's config is used as it is", {}),
    _only("rope_scaling", None, "the model's config is used as it is", {}),
    _only("rope_theta", None, "the model's config is used as it is"),
    _only("model_impl", "auto", "shmvllm has its own model classes only", "vllm"),
    _only("data_parallel_rank", None, _ONE_NODE, cli_type=int),
    _only("data_parallel_start_rank", None, _ONE_NODE, cli_type=int),
    _only("data_parallel_size_local", None, _ONE_NODE, cli_type=int),
    _only("data_parallel_address", None, _ONE_NODE),
    _only("data_parallel_rpc_port", None, _ONE_NODE, cli_type=int),
    _only("data_parallel_hybrid_lb", False, _ONE_NODE, cli_type=bool),
    _only("data_parallel_backend", "mp", "data-parallel engines are processes started by the LLM ('mp'); use shmvllm.ray for Ray"),
    _only("decode_context_parallel_size", 1, _CPU_TP + "; context parallelism is not implemented", cli_type=int),
    _only("distributed_executor_backend", None, "an engine runs its worker in-process (uni) or its tensor-parallel workers as processes (mp)", "uni", "mp"),
    _only("worker_cls", "auto", "shmvllm has one worker class"),
    _only("worker_extension_cls", "", "shmvllm has one worker class"),
    _only("scheduler_cls", None, "shmvllm has one scheduler", "vllm.v1.core.sched.scheduler.Scheduler"),
    _only("cpu_offload_gb", 0, "weights stay on the engine's device", cli_type=float),
    _only("enable_lora", False, "LoRA adapters are not supported", cli_type=bool),
    _only("enable_prompt_embeds", False, "prompts are text or token ids", cli_type=bool),
    _only("enable_mm_embeds", False, _NO_MM, cli_type=bool),
    _only("interleave_mm_strings", False, _NO_MM, cli_type=bool),
    _only("mm_processor_kwargs", None, _NO_MM, {}),
    _only("io_processor_plugin", None, "shmvllm has no plugins"),
    _only("kv_transfer_config", None, "KV transfer between engines is not supported"),
    _only("kv_events_config", None, "KV cache events are not published"),
    _only("kv_sharing_fast_prefill", False, "KV sharing across layers is not supported", cli_type=bool),
    _only("calculate_kv_scales", False, "the KV cache is not quantized", cli_type=bool),
    _only("override_attention_dtype", None, "attention runs in the model's dtype"),
    _only("logits_processors", None, "custom logits processor classes are not supported"),
    _only("logits_processor_pattern", None, "custom logits processors are not supported"),
    _only("reasoning_parser", "", "reasoning parsers are not supported"),
    _only("otlp_traces_endpoint", None, "tracing is not supported"),
    _only("collect_detailed_traces", None, "tracing is not supported"),
    _only("enable_sleep_mode", False, "sleep mode is not supported", cli_type=bool),
    _only("disable_sliding_window", False, "attention follows the model's config", cli_type=bool),
    _only("num_lookahead_slots", 0, "speculative decoding is not supported", cli_type=int),
    _only("max_num_partial_prefills", 1, "one partial prefill at a time", cli_type=int),
    _only("max_long_partial_prefills", 1, "one partial prefill at a time", cli_type=int),
    _only("long_prefill_token_threshold", 0, "one partial prefill at a time", cli_type=int),
    _only("model_loader_extra_config", None, "the loader has no options", {}),
    _only("logprobs_mode", "raw_logprobs", "logprobs are those of the raw logits, as vLLM's default"),
    _only("enable_return_routed_experts", False, "the outputs carry no routed expert ids", cli_type=bool),
    _only("profiler_config", None, "the torch profiler is not wired in"),
    _only("_api_process_count", 1, "no API server processes", cli_type=int),
    _only("_api_process_rank", 0, "no API server processes", cli_type=int),
)

BY_NAME: dict[str, VllmArg] = {arg.name: arg for arg in VLLM_ARGS}


def _field(arg: VllmArg) -> Any:
    if isinstance(arg.default, (dict, list)):
        return dataclasses.field(default_factory=type(arg.default), kw_only=True)
    return dataclasses.field(default=arg.default, kw_only=True)


VllmArgs = dataclasses.make_dataclass(
    "VllmArgs",
    [(arg.name, Any, _field(arg)) for arg in VLLM_ARGS],
)
VllmArgs.__doc__ = "vLLM's engine arguments without a shmvllm knob of their own (see VLLM_ARGS)."


def check_vllm_args(values: dict[str, Any]) -> None:
    """ValueError naming the first argument whose value asks for something shmvllm lacks."""
    for arg in VLLM_ARGS:
        if arg.ignored or arg.name not in values:
            continue
        value = values[arg.name]
        if not any(value is ok or (value == ok and isinstance(value, bool) == isinstance(ok, bool)) for ok in arg.allowed):
            accepted = " or ".join(repr(v) for v in arg.allowed)
            raise ValueError(f"{arg.name}={value!r} is not supported: {arg.why} (accepted: {accepted}).")
