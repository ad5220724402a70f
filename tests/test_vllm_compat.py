"""shmvllm.install_as_vllm() and vLLM's LLM / EngineArgs surface: every vLLM engine argument is
accepted (no effect where it changes nothing here) or refused naming it; vLLM's spellings; the
LLM methods and keywords vLLM programs use."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from shmvllm.compat.v1_detokenizer import BaseIncrementalDetokenizer, IncrementalDetokenizer as V1IncrementalDetokenizer
from shmvllm.compat.v1_engine import EngineCoreRequest as V1EngineCoreRequest
from shmvllm import LLM, SamplingParams
from shmvllm.compat.vllm_args import VLLM_ARGS
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.lora import LoRARequest
from shmvllm.outputs import RequestOutput
from shmvllm.pooling_params import PoolingParams

REPO = Path(__file__).resolve().parent.parent

# vLLM 0.11's EngineArgs fields (vllm/engine/arg_utils.py), and the LLM() keywords of later
# versions (attention_config, profiler_config, enable_return_routed_experts): the reference list.
VLLM_ENGINE_ARGS = """
model served_model_name tokenizer hf_config_path runner convert task skip_tokenizer_init
enable_prompt_embeds tokenizer_mode trust_remote_code allowed_local_media_path allowed_media_domains
download_dir safetensors_load_strategy load_format config_format dtype kv_cache_dtype seed
max_model_len cuda_graph_sizes cudagraph_capture_sizes max_cudagraph_capture_size
distributed_executor_backend pipeline_parallel_size tensor_parallel_size decode_context_parallel_size
data_parallel_size data_parallel_rank data_parallel_start_rank data_parallel_size_local
data_parallel_address data_parallel_rpc_port data_parallel_hybrid_lb data_parallel_backend
enable_expert_parallel all2all_backend enable_dbo dbo_decode_token_threshold dbo_prefill_token_threshold
disable_nccl_for_dp_synchronization eplb_config enable_eplb expert_placement_strategy _api_process_count
_api_process_rank num_redundant_experts eplb_window_size eplb_step_interval eplb_log_balancedness
max_parallel_loading_workers block_size enable_prefix_caching prefix_caching_hash_algo
disable_sliding_window disable_cascade_attn swap_space cpu_offload_gb gpu_memory_utilization
kv_cache_memory_bytes max_num_batched_tokens max_num_partial_prefills max_long_partial_prefills
long_prefill_token_threshold max_num_seqs max_logprobs logprobs_mode disable_log_stats
aggregate_engine_logging revision code_revision rope_scaling rope_theta hf_token hf_overrides
tokenizer_revision quantization enforce_eager disable_custom_all_reduce limit_mm_per_prompt
enable_mm_embeds interleave_mm_strings media_io_kwargs mm_processor_kwargs disable_mm_preprocessor_cache
mm_processor_cache_gb mm_processor_cache_type mm_shm_cache_max_object_size_mb mm_encoder_tp_mode
mm_encoder_attn_backend io_processor_plugin skip_mm_profiling video_pruning_rate enable_lora max_loras
max_lora_rank default_mm_loras fully_sharded_loras max_cpu_loras lora_dtype lora_extra_vocab_size
ray_workers_use_nsight num_gpu_blocks_override num_lookahead_slots model_loader_extra_config
ignore_patterns enable_chunked_prefill disable_chunked_mm_input disable_hybrid_kv_cache_manager
structured_outputs_config reasoning_parser guided_decoding_backend guided_decoding_disable_fallback
guided_decoding_disable_any_whitespace guided_decoding_disable_additional_properties
logits_processor_pattern speculative_config show_hidden_metrics_for_version otlp_traces_endpoint
collect_detailed_traces scheduling_policy scheduler_cls pooler_config override_pooler_config
compilation_config worker_cls worker_extension_cls kv_transfer_config kv_events_config generation_config
enable_sleep_mode override_generation_config model_impl override_attention_dtype calculate_kv_scales
mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size additional_config use_tqdm_on_load
pt_load_map_location enable_multimodal_encoder_data_parallel logits_processors async_scheduling
kv_sharing_fast_prefill attention_config profiler_config enable_return_routed_experts
""".split()


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), multiprocess=False, max_model_len=256, num_kv_blocks=128) as llm:
        yield llm


def greedy_ids(llm, prompt, max_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


# ---- install_as_vllm --------------------------------------------------------------------------


def test_install_as_vllm_maps_vllm_modules_to_shmvllm_modules():
    """In a fresh interpreter: the names vLLM programs import resolve to shmvllm's own objects."""
    result = run_python("""
        import importlib.metadata, importlib.util, sys
        import shmvllm
        assert importlib.util.find_spec("vllm") is None
        shmvllm.install_as_vllm()
        shmvllm.install_as_vllm()  # idempotent
        import vllm
        from vllm import LLM, SamplingParams, TokensPrompt, TextPrompt, PoolingParams, RequestOutput
        from vllm import EngineArgs, CompletionOutput, EmbeddingRequestOutput
        import vllm.sampling_params, vllm.outputs, vllm.inputs, vllm.pooling_params, vllm.logprobs, vllm.config
        from vllm.lora.request import LoRARequest
        from vllm.engine.arg_utils import EngineArgs as EA
        from vllm.inputs.data import TokensPrompt as TP
        from vllm.sampling_params import BeamSearchParams, RequestOutputKind
        from vllm.outputs import Logprob as OutputsLogprob
        from vllm.logprobs import Logprob, FlatLogprobs
        from vllm.transformers_utils.tokenizer import get_tokenizer
        from vllm.entrypoints.chat_utils import resolve_hf_chat_template
        from vllm.utils import FlexibleArgumentParser
        from vllm.v1.metrics.reader import Counter, Gauge, Histogram
        from vllm.v1.engine import EngineCoreRequest as V1Request, FinishReason
        from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer, FastIncrementalDetokenizer, IncrementalDetokenizer
        from vllm.v1.engine.core import EngineCore
        from vllm.distributed import cleanup_dist_env_and_memory
        from vllm.platforms import current_platform
        from vllm.tasks import PoolingTask, POOLING_TASKS
        from vllm.config import PoolerConfig
        import shmvllm.config
        assert PoolerConfig is shmvllm.config.PoolerConfig and PoolerConfig(pooling_type="MEAN").seq_pooling_type == "MEAN"
        import shmvllm.compat.v1_engine, shmvllm.engine.core
        assert V1Request is shmvllm.compat.v1_engine.EngineCoreRequest and EngineCore is shmvllm.engine.core.EngineCore
        assert current_platform.is_cpu() != current_platform.is_cuda() and not current_platform.is_rocm()
        cleanup_dist_env_and_memory()
        import shmvllm.sampling_params, shmvllm.entrypoints.llm, shmvllm.lora
        assert vllm.sampling_params is shmvllm.sampling_params
        assert shmvllm.sampling_params.__spec__.name == "shmvllm.sampling_params"
        assert LLM is shmvllm.entrypoints.llm.LLM and SamplingParams is shmvllm.SamplingParams
        assert LoRARequest is shmvllm.lora.LoRARequest and EA is EngineArgs and TP is TokensPrompt
        assert importlib.metadata.version("vllm") == vllm.__version__ == shmvllm.VLLM_API_VERSION
        assert importlib.util.find_spec("vllm") is not None
        for missing in ("vllm.model_executor", "vllm.tokenizers", "vllm.sampling_params.nothing"):
            try:
                __import__(missing)
            except ModuleNotFoundError as e:
                assert e.name == missing, e
            else:
                raise AssertionError(missing)
        for module, name in (("vllm", "AsyncEngineArgs"), ("vllm.sampling_params", "NoSuchName")):
            try:
                exec(f"from {module} import {name}")
            except ImportError as e:
                assert name in str(e)
            else:
                raise AssertionError(name)
        print("OK")
    """)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


def test_install_as_vllm_refuses_a_vllm_already_imported():
    result = run_python("""
        import sys, types, shmvllm
        sys.modules["vllm"] = types.ModuleType("vllm")
        try:
            shmvllm.install_as_vllm()
        except RuntimeError as e:
            print("refused:", e)
    """)
    assert "refused: a vllm module is already imported" in result.stdout, result.stderr[-2000:]


# ---- EngineArgs / LLM(...) arguments ---------------------------------------------------------


def test_engine_args_has_every_vllm_argument_with_an_explicit_policy():
    fields = EngineArgs.field_names()
    assert not [name for name in VLLM_ENGINE_ARGS if name not in fields]
    table = {arg.name for arg in VLLM_ARGS}
    own = fields - table
    assert own >= {"model", "dtype", "max_model_len", "kv_cache_memory_bytes", "runner", "max_logprobs"}
    assert all(arg.why for arg in VLLM_ARGS)


def test_ignored_arguments_are_accepted_at_any_value_and_change_nothing(llm, tiny_llama_dir):
    ignored = dict(
        enforce_eager=True, trust_remote_code=True, download_dir="/nowhere", disable_log_stats=False, swap_space=0,
        compilation_config={"level": 3}, attention_config={"backend": "FLASH_ATTN"}, tokenizer_mode="auto",
        revision=None, hf_token="x", served_model_name="alias", max_seq_len_to_capture=1, use_tqdm_on_load=False,
        limit_mm_per_prompt={"image": 0}, max_lora_rank=64,
    )
    assert all(not arg.ignored or arg.name in EngineArgs.field_names() for arg in VLLM_ARGS)
    with LLM(model=str(tiny_llama_dir), multiprocess=False, max_model_len=256, num_kv_blocks=64, **ignored) as other:
        assert greedy_ids(other, "Hello there") == greedy_ids(llm, "Hello there")


@pytest.mark.parametrize("name, value", [
    ("quantization", "awq"), ("enable_lora", True), ("speculative_config", {"method": "eagle", "num_speculative_tokens": 2}),
    ("tensor_parallel_size", 4), ("pipeline_parallel_size", 3), ("kv_cache_dtype", "fp8"), ("revision", "main"),
    ("hf_overrides", {"num_hidden_layers": 1}), ("runner", "draft"), ("convert", "classify"),
    ("tokenizer_mode", "mistral"), ("logits_processors", ["my.Processor"]), ("cpu_offload_gb", 4),
    ("enable_sleep_mode", True), ("distributed_executor_backend", "ray"), ("dtype", "int8"),
    ("enable_expert_parallel", True), ("enable_eplb", True), ("num_redundant_experts", 2),
])
def test_unsupported_arguments_raise_value_error_naming_them(tiny_llama_dir, name, value):
    with pytest.raises(ValueError, match=name):
        LLM(model=str(tiny_llama_dir), multiprocess=False, **{name: value})


def test_unknown_argument_is_a_type_error_naming_it(tiny_llama_dir):
    with pytest.raises(TypeError, match="no_such_knob"):
        LLM(model=str(tiny_llama_dir), no_such_knob=1)


def test_vllm_spellings(tiny_llama_dir, tiny_bert_dir):
    def config(**kw):
        return EngineArgs(**kw).create_engine_config()

    assert config(model=str(tiny_llama_dir), dtype="half").model_config.dtype == "float16"
    assert config(model=str(tiny_llama_dir), dtype="float").model_config.dtype == "float32"
    assert config(model=str(tiny_llama_dir), kv_cache_memory_bytes=2**20).cache_config.kv_cache_memory == 2**20
    assert config(model=str(tiny_llama_dir), num_gpu_blocks_override=7).cache_config.num_kv_blocks == 7
    assert config(model=str(tiny_llama_dir), max_logprobs=5).model_config.max_logprobs == 5
    assert config(model=str(tiny_llama_dir), seed=None).model_config.seed == 0
    assert config(model=str(tiny_bert_dir), runner="pooling").model_config.task == "embed"
    assert config(model=str(tiny_bert_dir), convert="embed").model_config.task == "embed"
    assert config(model=str(tiny_bert_dir), task="embedding").model_config.task == "embed"
    with pytest.raises(ValueError, match="convert='embed'"):
        config(model=str(tiny_llama_dir), convert="embed")
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        config(model=str(tiny_llama_dir), kv_cache_memory=1, kv_cache_memory_bytes=1)


def test_llm_takes_asdict_of_engine_args(tiny_llama_dir, llm):
    args = dataclasses.asdict(EngineArgs(model=str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, seed=3))
    with LLM(multiprocess=False, **args) as other:
        assert greedy_ids(other, "Hello") == greedy_ids(llm, "Hello")


def test_add_cli_args_and_from_cli_args(tiny_llama_dir):
    from shmvllm.compat.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="smollm2-135m-instruct")
    args = parser.parse_args(["--max-model-len", "128", "--enforce-eager", "--max_num_seqs", "4", "--dtype", "float",
                              "--no-enable-prefix-caching", "--compilation-config", '{"level": 0}'])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.model, engine_args.max_model_len, engine_args.max_num_seqs) == ("smollm2-135m-instruct", 128, 4)
    assert engine_args.enforce_eager is True and engine_args.enable_prefix_caching is False
    assert engine_args.compilation_config == {"level": 0} and engine_args.dtype == "float"
    assert set(vars(args)) == EngineArgs.field_names()  # LLM(**vars(args)) takes them all
    defaults = vars(parser.parse_args([]))
    assert all(defaults[f.name] == getattr(EngineArgs(), f.name) for f in dataclasses.fields(EngineArgs))


# ---- LLM methods and keywords -----------------------------------------------------------------


def test_generate_keywords_lora_priority_tokenization_kwargs(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer("one two three four five six")["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate("one two three four five six", params, use_tqdm=False, lora_request=None, priority=[0],
                       tokenization_kwargs={"truncate_prompt_tokens": 3})[0]
    assert out.prompt_token_ids == ids[-3:]
    assert out.outputs[0].token_ids == greedy_ids(llm, {"prompt_token_ids": ids[-3:]}, 4)
    bars = []

    class Bar:  # vLLM: use_tqdm may be a factory of the progress bar
        def __init__(self, **kwargs):
            self.n, self.kwargs = 0, kwargs
            bars.append(self)

        def update(self, count):
            self.n += count

        def set_postfix_str(self, text):
            pass

        def close(self):
            pass

    assert len(llm.generate(["a", "b"], params, use_tqdm=Bar)) == 2 and len(bars) == 1 and bars[0].n == 2
    no_special = llm.generate("one", params, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})[0]
    assert no_special.prompt_token_ids == tokenizer("one", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate("x", params, lora_request=LoRARequest("adapter", 1, "/adapter"))
    with pytest.raises(ValueError, match="tokenization_kwargs"):
        llm.generate("x", params, tokenization_kwargs={"padding": True})
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": 1}}, params)
    assert not llm.llm_engine.has_unfinished_requests()


def test_bare_token_id_lists_and_tokens_prompt(llm):
    from shmvllm.inputs import TokensPrompt

    ids = llm.get_tokenizer()("Hello there")["input_ids"]
    expected = greedy_ids(llm, {"prompt_token_ids": ids})
    assert greedy_ids(llm, ids) == expected
    assert greedy_ids(llm, TokensPrompt(prompt_token_ids=ids)) == expected
    both = llm.generate([ids, ids[:2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert both[0].outputs[0].token_ids == expected and both[1].prompt_token_ids == ids[:2]


def test_chat_keywords_render_as_transformers_apply_chat_template(llm):
    """Reference: the tokenizer's apply_chat_template with the same arguments."""
    tokenizer = llm.get_tokenizer()
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if tools %}[{{ tools | length }} tools]{% endif %}{{ greeting }}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"greeting": "!"}, tools=tools)[0]
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Hi\nthere"}], chat_template=template,
                                             tools=tools, greeting="!", add_generation_prompt=True, tokenize=False)
    assert out.prompt == expected == "<user>Hi\nthere[1 tools]!<assistant>"
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    cont = llm.chat(conversation, SamplingParams(max_tokens=1), use_tqdm=False, add_generation_prompt=False,
                    continue_final_message=True)[0]
    assert cont.prompt == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False,
                                                        continue_final_message=True)
    with pytest.raises(ValueError, match="not supported"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_get_default_sampling_params_from_generation_config(tiny_llama_dir, tmp_path):
    """Reference: the generation_config.json written here, read as vLLM reads it."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_new_tokens=7)
    (model / "generation_config.json").write_text(json.dumps(config))
    with LLM(model=str(model), multiprocess=False, max_model_len=128, num_kv_blocks=32) as llm:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == (
            0.6, 0.9, 20, 1.1, 7)
        out = llm.generate("Hello", use_tqdm=False)[0].outputs[0]  # None: these defaults
        assert len(out.token_ids) <= 7
    with LLM(model=str(model), multiprocess=False, max_model_len=128, num_kv_blocks=32, generation_config="vllm",
             override_generation_config={"temperature": 0.3}) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.3)


def test_tokenizer_model_config_metrics_and_request_metrics(llm, tiny_llama_dir):
    from shmvllm.metrics import Counter, Gauge, Histogram

    config = llm.llm_engine.model_config
    assert llm.model_config is config
    assert (config.max_model_len, config.get_vocab_size(), config.runner_type) == (256, 49152, "generate")
    assert config.hf_config.num_hidden_layers == 2 and config.tokenizer == str(tiny_llama_dir)
    assert llm.get_tokenizer().eos_token_id == 2
    before = {m.name: m for m in llm.get_metrics() if not isinstance(m, Counter) or m.name != "vllm:request_success"}
    outs = llm.generate(["a b", "c d e"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    after = llm.get_metrics()
    by_name = {m.name: m for m in after if m.name != "vllm:request_success"}
    assert by_name["vllm:prompt_tokens"].value - before["vllm:prompt_tokens"].value == sum(
        len(o.prompt_token_ids) for o in outs)
    assert by_name["vllm:generation_tokens"].value - before["vllm:generation_tokens"].value == 10
    assert isinstance(by_name["vllm:num_requests_running"], Gauge) and by_name["vllm:num_requests_running"].value == 0
    ttft = by_name["vllm:time_to_first_token_seconds"]
    assert isinstance(ttft, Histogram) and ttft.count - before["vllm:time_to_first_token_seconds"].count == 2
    assert ttft.buckets["+Inf"] == ttft.count
    for out in outs:
        stats = out.metrics
        assert stats.num_generation_tokens == 5 and stats.arrival_time <= stats.first_token_ts <= stats.last_token_ts
        assert stats.first_token_latency >= 0


def test_per_request_token_histograms_count_each_finished_sequence(llm):
    from shmvllm.metrics import Histogram

    def histograms():
        return {m.name: m for m in llm.get_metrics() if isinstance(m, Histogram)}

    before = histograms()
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True)]
    outs = llm.generate(["one two", "three four five six"], params, use_tqdm=False)
    after = histograms()
    generated = after["vllm:request_generation_tokens"]
    # bounds 1, 2, 5, 10, 20, 50, 100, 200 (the llm's max_model_len is 256), cumulative
    assert list(generated.buckets) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"]
    delta = {b: generated.buckets[b] - before["vllm:request_generation_tokens"].buckets[b] for b in generated.buckets}
    assert (delta["2.0"], delta["5.0"], delta["10.0"], delta["20.0"], delta["+Inf"]) == (0, 1, 1, 3, 3)
    assert generated.count - before["vllm:request_generation_tokens"].count == 3
    assert generated.sum - before["vllm:request_generation_tokens"].sum == 3 + 12 + 12
    prompts = after["vllm:request_prompt_tokens"]
    assert prompts.count - before["vllm:request_prompt_tokens"].count == 3
    assert prompts.sum - before["vllm:request_prompt_tokens"].sum == len(outs[0].prompt_token_ids) + 2 * len(
        outs[1].prompt_token_ids)


def test_skip_tokenizer_init_takes_token_ids_and_returns_no_text(tiny_llama_dir, llm):
    ids = llm.get_tokenizer()("Hello there")["input_ids"]
    with LLM(model=str(tiny_llama_dir), multiprocess=False, max_model_len=256, num_kv_blocks=64,
             skip_tokenizer_init=True) as bare:
        out = bare.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False),
                            use_tqdm=False)[0].outputs[0]
        assert out.token_ids == greedy_ids(llm, ids) and out.text == ""
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            bare.generate("text", use_tqdm=False)
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            bare.get_tokenizer()


# ---- pooling ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedder():
    with LLM(model="all-minilm-l6-v2", multiprocess=False) as llm:
        yield llm


def test_embeddings_are_lists_of_floats_with_a_zero_copy_numpy_view(embedder):
    out = embedder.embed(["hello world"], use_tqdm=False)[0].outputs
    assert isinstance(out.embedding, list) and all(type(v) is float for v in out.embedding)
    view = out.numpy()
    assert view.dtype == np.float32 and not view.flags.writeable and not view.flags.owndata
    assert out.embedding == view.tolist() and out.hidden_size == 384


def test_encode_pooling_task_classify_and_score(embedder):
    """score: the cosine of the two embeddings, against sentence-transformers' cos_sim."""
    from sentence_transformers import SentenceTransformer, util

    from shmvllm.model.registry import resolve_model_dir

    texts = ["A man is eating food.", "A man is eating pasta.", "The girl carries a baby."]
    encoded = embedder.encode(texts, pooling_task="embed", use_tqdm=False)
    embedded = embedder.embed(texts, use_tqdm=False)
    for enc, emb in zip(encoded, embedded):
        np.testing.assert_array_equal(enc.outputs.data.numpy(), emb.outputs.numpy())
    with pytest.raises(ValueError, match="pooling_task='classify'"):
        embedder.encode(texts, pooling_task="classify")
    with pytest.raises(ValueError, match="Classification"):
        embedder.classify(texts)
    scores = embedder.score(texts[0], texts[1:], use_tqdm=False)
    reference = SentenceTransformer(str(resolve_model_dir("all-minilm-l6-v2")), device="cpu")
    vectors = reference.encode(texts, convert_to_tensor=True)
    expected = util.cos_sim(vectors[:1], vectors[1:])[0].tolist()
    np.testing.assert_allclose([s.outputs.score for s in scores], expected, atol=1e-5)
    pairwise = embedder.score(texts[:2], texts[1:], use_tqdm=False)
    np.testing.assert_allclose(pairwise[0].outputs.score, util.cos_sim(vectors[0], vectors[1]).item(), atol=1e-5)
    truncated = embedder.embed(texts[0], use_tqdm=False, truncate_prompt_tokens=3)[0]
    assert truncated.prompt_token_ids == embedder.get_tokenizer()(texts[0])["input_ids"][-3:]
    via_params = embedder.embed(texts[0], PoolingParams(truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert via_params.outputs == truncated.outputs


def test_use_activation_is_vllms_normalize_for_embeddings_and_refusals_use_vllms_words(embedder):
    text = "A man is eating food."
    def vector(**params):
        return np.asarray(embedder.embed(text, PoolingParams(**params), use_tqdm=False)[0].outputs.embedding)
    raw, normed = vector(use_activation=False), vector(use_activation=True)
    np.testing.assert_array_equal(raw, vector(normalize=False))
    np.testing.assert_array_equal(normed, vector())
    np.testing.assert_allclose(normed, raw / np.linalg.norm(raw), rtol=1e-5)
    assert abs(np.linalg.norm(raw) - 1) > 1e-2
    with pytest.raises(ValueError, match="use_activation=True contradicts normalize=False"):
        vector(use_activation=True, normalize=False)
    for task, words in (("classify", "Classification API is not supported by this model"),
                        ("plugin", "No IOProcessor plugin installed")):
        with pytest.raises(ValueError, match=words):
            embedder.encode(text, pooling_task=task, use_tqdm=False)


def test_the_porting_guide_lists_every_argument_with_its_reason():
    guide = (REPO / "docs" / "porting.md").read_text()
    table = guide[guide.index("vLLM engine arguments accepted at any value"):]
    assert all(f"`{arg.name}`" in table for arg in VLLM_ARGS)
    for arg in VLLM_ARGS:
        if arg.ignored:
            row = next(line for line in table.splitlines() if f"`{arg.name}`" in line and line.startswith("|"))
            assert row.rstrip(" |").endswith(arg.why), (arg.name, row, arg.why)


# ---- the surface vLLM's own offline tests touch ---------------------------------------------


def test_prompt_errors_carry_vllms_wording_and_the_llm_keeps_serving(llm):
    cases = [("", "decoder prompt cannot be empty"),
             ({"prompt_token_ids": [5, 999999]}, "Token id 999999 is out of vocabulary"),
             ({"prompt_token_ids": [5] * 300}, "maximum context length is 256 tokens.*300 input tokens")]
    for prompt, words in cases:
        with pytest.raises(ValueError, match=words):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(greedy_ids(llm, "Hello", 4)) == 4


def test_request_output_takes_keywords_of_later_vllm_versions(caplog):
    with caplog.at_level("WARNING", logger="shmvllm.outputs"):
        output = RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1, 2], prompt_logprobs=None,
                               outputs=[], finished=False, field_of_a_later_version=1)
    assert (output.request_id, output.prompt_token_ids, output.finished) == ("r", [1, 2], False)
    assert "field_of_a_later_version" in caplog.text
    with pytest.raises(TypeError, match="finished"):
        RequestOutput(request_id="r", prompt=None, prompt_token_ids=[], prompt_logprobs=None, outputs=[])


class _LetterDetokenizer(BaseIncrementalDetokenizer):
    """Token id i is the character chr(i): the text is known exactly."""

    def decode_next(self, next_token_id: int) -> str:
        return chr(next_token_id)


def _v1_request(**params) -> V1EngineCoreRequest:
    return V1EngineCoreRequest(request_id="r", prompt_token_ids=[1], mm_features=None,
                               sampling_params=SamplingParams(**params), pooling_params=None, arrival_time=0.0,
                               lora_request=None, cache_salt=None, data_parallel_rank=None)


def test_v1_detokenizer_stops_past_min_tokens_and_buffers_what_could_start_a_stop_string():
    ids = [ord(c) for c in "xyz-abc-abd"]
    # the "b" at index 5 lies in the first six tokens' text: only the next one stops it
    detok = _LetterDetokenizer(_v1_request(stop=["b"], min_tokens=6))
    assert detok.update(ids, stop_terminated=False) == "b"
    assert detok.output_text == "xyz-abc-a" and detok.output_token_ids == ids
    # while unfinished, the last len(longest stop) - 1 characters are held back
    detok = _LetterDetokenizer(_v1_request(stop=["z-a", "c-"]))
    assert detok.update(ids[:3], False) is None and detok.get_next_output_text(False, True) == "x"
    assert detok.update(ids[3:5], False) == "z-a" and detok.output_text == "xy"
    assert detok.get_next_output_text(True, True) == "y"
    detok = _LetterDetokenizer(_v1_request(stop=["c-"], include_stop_str_in_output=True))
    assert detok.update(ids, False) == "c-" and detok.get_next_output_text(False, False) == "xyz-abc-"
    # a stop-terminated last id stays out of the text unless the stop string is to be shown
    detok = _LetterDetokenizer(_v1_request(stop=["q"]))
    assert detok.update(ids[:4], stop_terminated=True) is None
    assert detok.output_text == "xyz" and detok.output_token_ids == ids[:4]
    with pytest.raises(ValueError, match="mm_features"):
        V1EngineCoreRequest(request_id="r", prompt_token_ids=[1], mm_features=[object()], sampling_params=SamplingParams(),
                            pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None)


def test_v1_fast_detokenizer_concatenates_to_the_tokenizers_decode(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer("Héllo wörld — ünïcödé 😀 text", add_special_tokens=False).input_ids
    detok = V1IncrementalDetokenizer.from_new_request(tokenizer, _v1_request())
    for token_id in ids:
        detok.update([token_id], stop_terminated=False)
    assert type(detok).__name__ == "FastIncrementalDetokenizer"
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    wire = _v1_request(max_tokens=3).to_wire()
    assert wire.request_id == "r" and list(wire.prompt_token_ids) == [1] and wire.sampling_params.max_tokens == 3


def test_stop_strings_end_past_the_first_min_tokens_tokens(llm):
    """vLLM's rule, in the engine's own output processor: a stop string inside the text of the
    first min_tokens tokens does not stop the request."""
    tokenizer = llm.get_tokenizer()
    ids = greedy_ids(llm, "Once upon a time", 12)
    full = tokenizer.decode(ids)
    first = tokenizer.decode(ids[:2])
    stop = first.strip()[-1]
    at = full.find(stop, len(first))
    expected = full[:at] if at != -1 else full
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=2)
    assert llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].text == expected
