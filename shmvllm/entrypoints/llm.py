"""LLM: vLLM's offline API (`generate`, `chat`, `embed`, `encode`) over an LLMEngine."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Optional, Sequence, Union

import msgspec

import numpy as np

from shmvllm.beam_search import BeamSearchOutput, beam_prompt_ids, run_beam_search
from shmvllm.boundary.messages import EngineCoreRequest
from shmvllm.engine.arg_utils import EngineArgs
from shmvllm.engine.input_processor import PromptType, check_prompt_keys, params_per_prompt, parse_tokenization_kwargs
from shmvllm.engine.llm_engine import LLMEngine
from shmvllm.engine.renderer import Conversation
from shmvllm.entrypoints.output_router import OutputRouter, Sink
from shmvllm.lora import check_no_lora
from shmvllm.metrics import Metric
from shmvllm.engine.validation import as_conversations, as_prompt_list
from shmvllm.model.encoders import pooling_tasks
from shmvllm.model.registry import DEFAULT_MODEL
from shmvllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from shmvllm.pooling_params import PoolingParams
from shmvllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

Prompts = Union[PromptType, Sequence[PromptType]]
ParamsArg = Union[SamplingParams, Sequence[SamplingParams], None]
PoolingParamsArg = Union[PoolingParams, Sequence[PoolingParams], None]
UseTqdm = Union[bool, Callable[..., Any]]

# embed/encode tokenize this many texts per tokenizer call, and send them while the engine
# computes what came before.
POOLING_TOKENIZE_CHUNK = 256
# Requests in flight (sent, not yet finished) stay under this many engine steps' worth, so the
# engine always has work queued while the frontend's memory and the progress bar stay bounded.
# (A full ring cannot deadlock the two sides: see the flow-control rule in shmvllm/boundary/channel.py.)
POOLING_MAX_IN_FLIGHT_STEPS = 2  # x max_num_seqs


class LLM:
    """An LLM for offline inference.

    LLM(model=..., **engine_args): engine_args are EngineArgs' fields: shmvllm's knobs under
    vLLM's names (dtype, max_model_len, max_num_seqs, kv_cache_memory_bytes, ...) and the rest of
    vLLM's engine arguments, accepted where they make no difference here and refused with a
    ValueError naming them where they ask for what shmvllm lacks (README, "Porting from vLLM").
    An argument vLLM does not have either is a TypeError. multiprocess: run the engine in its
    own process (the default; over shared-memory rings) or in this one. request_timeout_s: a call that gets no
    output from the engine for this long raises EngineTimeoutError (a TimeoutError naming the
    engine's state) and aborts its requests (None: wait as long as it takes; the engine's death
    is noticed either way).

    Threads: one LLM may be called from many threads at once (generate, chat, embed, encode,
    score, beam_search, get_metrics). Each call returns exactly its own outputs, the requests of
    all callers share the engine's steps (continuous batching across callers), and a caller
    that is interrupted aborts only its own requests. If the engine dies, every waiting call
    raises EngineDeadError.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        multiprocess: bool = True,
        request_timeout_s: Optional[float] = None,
        **engine_args: Any,
    ):
        unknown = sorted(set(engine_args) - EngineArgs.field_names())
        if unknown:
            raise TypeError(f"LLM() got unexpected engine arguments {unknown}; known: {sorted(EngineArgs.field_names())}.")
        if request_timeout_s is not None and (
            isinstance(request_timeout_s, bool) or not isinstance(request_timeout_s, (int, float))
            or not request_timeout_s > 0 or request_timeout_s == float("inf")
        ):
            raise ValueError(f"request_timeout_s must be a positive number of seconds or None, got {request_timeout_s!r}.")
        self.request_timeout_s = request_timeout_s
        self.engine_args = EngineArgs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, multiprocess=multiprocess)
        self.llm_engine.set_request_timeout(request_timeout_s)
        self.model_config = self.llm_engine.model_config
        self.supported_tasks: tuple[str, ...] = (
            pooling_tasks(self.model_config.hf_config) if self.model_config.is_embedding else ("generate",)
        )
        pooler = self.model_config.pooler_config
        # vLLM's rule: a pooling model is bound to one task, PoolerConfig.task or its first
        self.pooling_task: Optional[str] = (
            (pooler.task if pooler is not None and pooler.task else self.supported_tasks[0])
            if self.model_config.is_embedding else None
        )
        self._st: Any = None  # the model's sentence-transformers config, read on first use
        self.default_sampling_params: Optional[dict[str, Any]] = None
        self.request_counter = itertools.count()
        self._router = OutputRouter(self.llm_engine)
        self._closed = False

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of the model's generation_config.json (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), as vLLM's."""
        if self.default_sampling_params is None:
            self.default_sampling_params = self.model_config.get_diff_sampling_param()
        return SamplingParams.from_optional(**self.default_sampling_params)

    def get_metrics(self) -> list[Metric]:
        """A snapshot of vLLM's metrics (vllm:prompt_tokens, vllm:num_requests_running, ...)."""
        return self._router.locked(self.llm_engine.get_metrics)

    def generate(
        self,
        prompts: Prompts,
        sampling_params: ParamsArg = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        priority: Optional[list[int]] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Completes each prompt; returns one finished RequestOutput per prompt, in input order.

        prompts: a str, a list of token ids, {"prompt": str}, {"prompt_token_ids": [...]}, or a
        list of those. sampling_params: one for all prompts, or one per prompt (default:
        get_default_sampling_params()). tokenization_kwargs: {"truncate_prompt_tokens": k,
        "add_special_tokens": bool}. Every prompt is validated before any is queued: a
        ValueError leaves the LLM as it was.
        """
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._run(self._process(prompts, sampling_params, priority, tokenization_kwargs, lora_request), use_tqdm)

    def chat(
        self,
        messages: Union[Conversation, list[Conversation]],
        sampling_params: ParamsArg = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        mm_processor_kwargs: Optional[dict[str, Any]] = None,
        priority: Optional[list[int]] = None,
    ) -> list[RequestOutput]:
        """Generates the next message of each conversation, rendered by the chat template
        (`chat_template` instead of the tokenizer's; `chat_template_kwargs`: extra template
        variables; `tools`: the template's tool list)."""
        self.llm_engine.input_processor.check_task(SamplingParams)
        check_no_lora(lora_request)
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs={mm_processor_kwargs!r} is not supported: shmvllm serves text-only models.")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        conversations = as_conversations(messages)
        renderer = self.llm_engine.renderer
        prompts: list[dict[str, Any]] = []
        for conversation in conversations:
            text, ids = renderer.render_chat(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                chat_template_content_format=chat_template_content_format,
            )
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self._run(self._process(prompts, sampling_params, priority, tokenization_kwargs), use_tqdm)

    def beam_search(
        self,
        prompts: list[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: Optional[int] = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (shmvllm.beam_search): the beam_width best sequences per prompt."""
        check_no_lora(lora_request)
        self.llm_engine.input_processor.check_task(SamplingParams)
        prompt_ids = beam_prompt_ids(self, as_prompt_list(prompts))
        step = concurrency_limit or len(prompt_ids)
        results: list[BeamSearchOutput] = []
        for start in range(0, len(prompt_ids), step):
            results.extend(run_beam_search(self, prompt_ids[start : start + step], params))
        return results

    def embed(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        priority: Optional[list[int]] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        *,
        truncate_prompt_tokens: Optional[int] = None,
        prompt_name: Optional[str] = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeds each prompt; one EmbeddingRequestOutput per prompt, in input order.

        prompts: a str, a list of token ids, {"prompt": str}, {"prompt_token_ids": [...]}, or a
        list of those; text is truncated to max_model_len tokens, as sentence-transformers does
        (truncate_prompt_tokens=k keeps the last k). pooling_params: one for all prompts, or one
        per prompt (default: PoolingParams(), the model's own pooling).
        prompt_name: as sentence-transformers' `encode`, the name of one of the model's prompts
        (config_sentence_transformers.json) put before each text prompt; by default the
        model's `default_prompt_name` one, if it has one.
        `.outputs.embedding` is a list of floats, as vLLM's; `.outputs.numpy()` the same vector
        as a float32 numpy array viewing the engine's output bytes (no copy).
        """
        check_no_lora(lora_request)
        kwargs = _with_truncation(tokenization_kwargs, truncate_prompt_tokens)
        return [
            EmbeddingRequestOutput.from_base(o)
            for o in self._pool(prompts, pooling_params, use_tqdm, priority, kwargs, "embed", prompt_name)
        ]

    def encode(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        pooling_task: Optional[str] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        *,
        truncate_prompt_tokens: Optional[int] = None,
        priority: Optional[list[int]] = None,
        prompt_name: Optional[str] = None,
    ) -> list[PoolingRequestOutput]:
        """The model's pooled output as `.outputs.data`, a float32 torch tensor, per prompt.
        pooling_task: "embed" (or vLLM's older "encode"): the embedding; "token_embed": every
        token's hidden state, [num_tokens, hidden_size]; "classify": the class probabilities;
        "score": a cross-encoder's score of one text (no pair). As in vLLM, a pooling model is bound
        to one task, `pooling_task` (`LLM(..., pooler_config={"task": ...})`, else the first of
        `supported_tasks`); another task is a ValueError naming it.
        prompt_name: as for `embed` (embedding tasks only)."""
        import torch

        check_no_lora(lora_request)
        kwargs = _with_truncation(tokenization_kwargs, truncate_prompt_tokens)
        outputs = self._pool(prompts, pooling_params, use_tqdm, priority, kwargs, pooling_task, prompt_name)
        for output in outputs:
            output.outputs.data = torch.from_numpy(output.outputs.data.copy())  # writable, owned
        return outputs

    def classify(
        self,
        prompts: Prompts,
        *,
        pooling_params: PoolingParamsArg = None,
        use_tqdm: UseTqdm = True,
        lora_request: Any = None,
        priority: Optional[list[int]] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> list[ClassificationRequestOutput]:
        """The class probabilities of each prompt from the model's classification head (softmax
        over the labels; sigmoid for one label or a multi-label model, raw for regression, as
        its config says; `PoolingParams(use_activation=False)`: the logits)."""
        check_no_lora(lora_request)
        kwargs = _with_truncation(tokenization_kwargs, truncate_prompt_tokens)
        return [
            ClassificationRequestOutput.from_base(o)
            for o in self._pool(prompts, pooling_params, use_tqdm, priority, kwargs, "classify")
        ]

    def score(
        self,
        data_1: Union[PromptType, Sequence[PromptType]],
        data_2: Union[PromptType, Sequence[PromptType]],
        /,
        *,
        use_tqdm: UseTqdm = True,
        pooling_params: Optional[PoolingParams] = None,
        lora_request: Any = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        truncate_prompt_tokens: Optional[int] = None,
        chat_template: Optional[str] = None,
    ) -> list[ScoringRequestOutput]:
        """Similarity of each pair (data_1[i], data_2[i]); one data_1 is paired with every data_2.
        A cross-encoder (a classification model with one label) runs each pair through its head,
        tokenized as a pair the way its tokenizer does (token types included), with the
        activation its sentence-transformers config names (sigmoid by default), as
        `CrossEncoder.predict`; an embedding model scores by the cosine of the two embeddings
        (vLLM's bi-encoder scoring)."""
        check_no_lora(lora_request)
        if not self.model_config.is_embedding:
            raise ValueError("LLM.score() is only supported for pooling models; this one generates.")
        if chat_template is not None:
            raise ValueError("chat_template is not supported: shmvllm's cross-encoders take the pair as the tokenizer joins it.")
        first = as_prompt_list(data_1)
        second = as_prompt_list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(f"data_1 has {len(first)} inputs and data_2 {len(second)}: give one, or as many as data_2.")
        kwargs = _with_truncation(tokenization_kwargs, truncate_prompt_tokens)
        if "score" in self.supported_tasks:
            return [ScoringRequestOutput.from_base(o) for o in self._score_pairs(first, second, pooling_params, use_tqdm, kwargs)]
        if "embed" not in self.supported_tasks:
            raise ValueError(f"Score API is not supported by model {self.model_config.model!r}: it does {list(self.supported_tasks)}.")
        encoded = self._pool(first + second, pooling_params, use_tqdm, None, kwargs, "embed")
        scores = []
        for a, b in zip(encoded[: len(first)], encoded[len(first) :]):
            va, vb = a.outputs.data.astype(np.float64), b.outputs.data.astype(np.float64)
            cosine = float(va @ vb / max(np.linalg.norm(va) * np.linalg.norm(vb), 1e-12))
            base = PoolingRequestOutput(
                request_id=f"{a.request_id}_{b.request_id}",
                outputs=PoolingOutput(data=np.array([cosine], dtype=np.float32)),
                prompt_token_ids=a.prompt_token_ids + b.prompt_token_ids,
                finished=True,
                error=a.error or b.error,
            )
            scores.append(ScoringRequestOutput.from_base(base))
        return scores

    def _pooling_task(self, task: Optional[str]) -> str:
        """The task a pooling call asks for, checked against the model's (None: its first)."""
        engine_task = "embed" if task == "encode" else task
        if engine_task is None:
            return self.pooling_task
        if engine_task in self.supported_tasks and engine_task not in (self.pooling_task, "score"):
            raise ValueError(
                f'Try switching the model\'s pooling_task via `PoolerConfig(task="{engine_task}")`: '
                f"model {self.model_config.model!r} is bound to pooling_task {self.pooling_task!r} "
                f"(LLM(..., pooler_config={{'task': {engine_task!r}}}))."
            )
        if engine_task not in self.supported_tasks:
            if engine_task == "plugin":
                raise ValueError("No IOProcessor plugin installed: shmvllm has no IO processor plugins "
                                 f"(pooling_task='plugin'); model {self.model_config.model!r} does {list(self.supported_tasks)}.")
            api = {"embed": "Embedding", "token_embed": "Embedding", "classify": "Classification",
                   "token_classify": "Classification", "score": "Score"}.get(engine_task, repr(engine_task))
            raise ValueError(
                f"{api} API is not supported by this model (pooling_task={task!r}): model "
                f"{self.model_config.model!r} does {list(self.supported_tasks)}."
            )
        return engine_task

    def _pool(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg,
        use_tqdm: UseTqdm,
        priority: Optional[list[int]],
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        task: Optional[str] = None,
        prompt_name: Optional[str] = None,
    ) -> list[PoolingRequestOutput]:
        """Validates everything, then tokenizes chunk by chunk while the engine pools what was
        sent before; returns the outputs in prompt order."""
        engine = self.llm_engine
        prompt_list = as_prompt_list(prompts)
        if not prompt_list:
            raise ValueError("prompts is empty.")
        params_list = _pooling_params_per_prompt(pooling_params, len(prompt_list))
        engine.input_processor.check_task(PoolingParams)
        engine_task = self._pooling_task(task)
        params_list = self._with_task(params_list, engine_task, task)
        tokenization_kwargs = _pooling_truncation(tokenization_kwargs, params_list)
        prompt_list = self._with_st_prompt(prompt_list, prompt_name, engine_task)
        engine.input_processor.check_pooling_batch(prompt_list, priority, tokenization_kwargs)

        def tokenize(start: int, chunk: list[PromptType]) -> list[tuple[Optional[str], list[int], PoolingParams]]:
            pairs = engine.input_processor.tokenize_for_pooling(chunk, tokenization_kwargs)
            return [(text, ids, params_list[start + i]) for i, (text, ids) in enumerate(pairs)]

        return self._send_pooling(prompt_list, tokenize, use_tqdm, priority)

    def _with_task(self, params_list: list[PoolingParams], engine_task: str, asked: Optional[str]) -> list[PoolingParams]:
        """Each distinct params object checked and given the call's task."""
        engine = self.llm_engine
        tasked: dict[int, PoolingParams] = {}
        for params in params_list:
            if id(params) in tasked:
                continue
            if params.task is not None and asked is not None and params.task != asked and params.task != engine_task:
                raise ValueError(f"pooling_params.task={params.task!r} contradicts the pooling task {asked!r}.")
            if params.task is not None and asked is None:
                engine_task = self._pooling_task(params.task)
            if params.dimensions is not None and engine_task != "embed":
                raise ValueError(f"pooling_params.dimensions is for task 'embed', not {engine_task!r}.")
            if params.extra_kwargs:
                raise ValueError("pooling_params.extra_kwargs is set by LLM.score for cross-encoder pairs, not by callers.")
            engine.input_processor.verify_pooling_params(params)
            changes: dict[str, Any] = {"task": engine_task, **self._pooler_defaults(params, engine_task)}
            if params.use_activation is not None and engine_task in ("embed", "token_embed"):
                # vLLM's current name of normalize for embedding tasks
                if params.normalize is not None and params.normalize != params.use_activation:
                    raise ValueError(f"pooling_params.use_activation={params.use_activation} contradicts "
                                     f"normalize={params.normalize} (for task {engine_task!r} both say whether to normalize).")
                changes.update(normalize=params.use_activation, use_activation=None)
            tasked[id(params)] = msgspec.structs.replace(params, **changes)
        return [tasked[id(p)] for p in params_list]

    def _pooler_defaults(self, params: PoolingParams, task: str) -> dict[str, Any]:
        """The PoolingParams fields a request left unset that the model's PoolerConfig sets."""
        pooler = self.model_config.pooler_config
        if pooler is None:
            return {}
        changes: dict[str, Any] = {}
        if task == "embed" and params.dimensions is None and pooler.dimensions is not None:
            changes["dimensions"] = pooler.dimensions
        if pooler.use_activation is not None and params.use_activation is None:
            if task in ("embed", "token_embed"):
                if params.normalize is None:
                    changes["normalize"] = pooler.use_activation
            else:
                changes["use_activation"] = pooler.use_activation
        return changes

    def _with_st_prompt(self, prompts: list[PromptType], prompt_name: Optional[str], task: str) -> list[PromptType]:
        """The text prompts with the model's sentence-transformers prompt before them: the one
        named, else the default one (token-id prompts stay as they are, as they are tokenized)."""
        st = self._st_config()
        if prompt_name is not None:
            if task not in ("embed", "token_embed"):
                raise ValueError(f"prompt_name is for embedding tasks, not {task!r}.")
            if prompt_name not in st.prompts:
                raise ValueError(f"prompt_name={prompt_name!r} is not one of the model's prompts {sorted(st.prompts)}.")
        elif task in ("embed", "token_embed"):
            prompt_name = st.default_prompt_name
        prefix = st.prompts.get(prompt_name, "") if prompt_name is not None else ""
        if not prefix:
            return prompts
        out: list[PromptType] = []
        for prompt in prompts:
            if isinstance(prompt, str):
                prompt = prefix + prompt
            elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str) and "prompt_token_ids" not in prompt:
                prompt = {**prompt, "prompt": prefix + prompt["prompt"]}
            out.append(prompt)
        return out

    def _st_config(self) -> Any:
        if self._st is None:
            from shmvllm.model.st_config import read_st_config

            self._st = read_st_config(self.model_config.model_dir, modules=False)
        return self._st

    def _score_pairs(
        self,
        first: list[PromptType],
        second: list[PromptType],
        pooling_params: Optional[PoolingParams],
        use_tqdm: UseTqdm,
        tokenization_kwargs: Optional[dict[str, Any]],
    ) -> list[PoolingRequestOutput]:
        """Each (first[i], second[i]) text pair through the cross-encoder's head."""
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}.")
        (params,) = self._with_task([pooling_params or PoolingParams()], "score", "score")
        truncate, add_special_tokens = parse_tokenization_kwargs(_pooling_truncation(tokenization_kwargs, [params]))
        if truncate is not None:
            raise ValueError("truncate_prompt_tokens is not supported for cross-encoder pairs: they are truncated to max_model_len as the tokenizer does.")
        texts = []
        for name, items in (("data_1", first), ("data_2", second)):
            for item in items:
                text = item.get("prompt") if isinstance(item, dict) and "prompt_token_ids" not in item else item
                if not isinstance(text, str):
                    raise TypeError(f"{name} must hold text (str or {{'prompt': str}}) for a cross-encoder, got {type(item).__name__}.")
                if isinstance(item, dict):
                    check_prompt_keys(item)
            texts.append([t.get("prompt") if isinstance(t, dict) else t for t in items])
        pairs = list(zip(*texts))
        tokenizer = self.llm_engine.renderer.tokenizer
        if tokenizer is None:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`: cross-encoder pairs need one.")
        uses_token_types = getattr(self.model_config.hf_config, "type_vocab_size", 1) > 1

        def tokenize(start: int, chunk: list[tuple[str, str]]) -> list[tuple[Optional[str], list[int], PoolingParams]]:
            encoded = tokenizer(
                [q for q, _ in chunk], [d for _, d in chunk], truncation=True,
                max_length=self.model_config.max_model_len, add_special_tokens=add_special_tokens,
            )
            types = encoded.get("token_type_ids") if uses_token_types else None
            out = []
            for i, ids in enumerate(encoded["input_ids"]):
                pair_params = params
                if types is not None and 1 in types[i]:
                    pair_params = msgspec.structs.replace(params, extra_kwargs={"compressed_token_type_ids": types[i].index(1)})
                out.append((None, ids, pair_params))
            return out

        return self._send_pooling(pairs, tokenize, use_tqdm, None)

    def _send_pooling(
        self,
        items: list[Any],
        tokenize: Callable[[int, list[Any]], list[tuple[Optional[str], list[int], PoolingParams]]],
        use_tqdm: UseTqdm,
        priority: Optional[list[int]],
    ) -> list[PoolingRequestOutput]:
        """Tokenizes `items` chunk by chunk (`tokenize(start, chunk)` -> (text, ids, params) each)
        and queues them while the engine works on what came before; the outputs in order."""
        engine = self.llm_engine
        request_ids = [str(next(self.request_counter)) for _ in items]
        router, sink = self._router, Sink()
        tracker = _PoolingTracker(router, sink, len(items), use_tqdm, self.request_timeout_s)
        max_in_flight = POOLING_MAX_IN_FLIGHT_STEPS * engine.config.scheduler_config.max_num_seqs
        sent = 0
        try:
            for start in range(0, len(items), POOLING_TOKENIZE_CHUNK):
                for text, ids, params in tokenize(start, items[start : start + POOLING_TOKENIZE_CHUNK]):
                    while tracker.in_flight >= max_in_flight:
                        tracker.collect()
                    router.register(sink, request_ids[sent])
                    router.locked(
                        engine.add_tokenized_pooling_request,
                        request_ids[sent], text, ids, params, priority[sent] if priority else 0,
                    )
                    tracker.in_flight += 1
                    sent += 1
            while sink.pending:
                tracker.collect()
        except BaseException:
            router.release(sink)
            router.locked(engine.abort_request, [rid for rid in request_ids[:sent] if rid not in tracker.finished])
            raise
        finally:
            tracker.close()
        missing = [rid for rid in request_ids if rid not in tracker.finished]
        if missing:
            raise RuntimeError(f"the engine finished without outputs for requests {missing[:10]}.")
        return [tracker.finished[rid] for rid in request_ids]

    def _process(self, prompts: Any, params: Any, priority: Optional[list[int]],
                 tokenization_kwargs: Optional[dict[str, Any]], lora_request: Any = None) -> list[Any]:
        """The call's requests, all validated by the input processor before `_run` queues any
        (offline calls only need each request's end: FINAL_ONLY)."""
        return self.llm_engine.input_processor.process_batch(
            prompts, params, priority, tokenization_kwargs, lora_request, RequestOutputKind.FINAL_ONLY
        )

    def _run(self, prepared: list[tuple[EngineCoreRequest, Optional[str], list[int]]], use_tqdm: UseTqdm) -> list[RequestOutput]:
        """Queues what `_process` made (setting the request ids) and waits for all of it."""
        request_ids: list[str] = []
        router, sink = self._router, Sink()
        add = self.llm_engine.add_processed_request
        try:
            for request, prompt_text, prompt_ids in prepared:
                request.request_id = request_id = str(next(self.request_counter))
                router.register(sink, request_id)
                router.locked(add, request, prompt_text, prompt_ids)
                request_ids.append(request_id)
            return self._run_engine(request_ids, use_tqdm, sink)
        except BaseException:
            router.release(sink)
            router.locked(self.llm_engine.abort_request, request_ids)
            raise

    def _run_engine(self, request_ids: list[str], use_tqdm: UseTqdm, sink: Optional[Sink] = None) -> list[RequestOutput]:
        """Waits until every request is finished; returns outputs in `request_ids` order.

        sink: where the router puts these requests' outputs (registered before they were added);
        without one, the requests are registered now (they were added by the caller)."""
        if sink is None:
            sink = Sink()
            for request_id in request_ids:
                self._router.register(sink, request_id)
        started = time.perf_counter()
        bar = _progress_bar(len(request_ids), use_tqdm) if use_tqdm and len(request_ids) > 1 else None
        finished: dict[str, RequestOutput] = {}
        prompt_tokens = output_tokens = 0
        while sink.pending:
            for output in self._router.next_outputs(sink, self.request_timeout_s):
                if not output.finished or not isinstance(output, RequestOutput):
                    continue
                finished[output.request_id] = output
                prompt_tokens += len(output.prompt_token_ids or ())
                output_tokens += sum(len(c.token_ids) for c in output.outputs)
                if output.error is not None:
                    logger.warning("request %s failed in the engine: %s", output.request_id, output.error)
                if bar is not None:
                    elapsed = max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix_str(
                        f"est. speed input: {prompt_tokens / elapsed:.1f} toks/s, output: {output_tokens / elapsed:.1f} toks/s"
                    )
                    bar.update(1)
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - started
        logger.info(
            "%d requests: %d prompt + %d output tokens in %.2f s (%.1f output tok/s)",
            len(request_ids), prompt_tokens, output_tokens, elapsed, output_tokens / max(elapsed, 1e-9),
        )
        missing = [rid for rid in request_ids if rid not in finished]
        if missing:
            raise RuntimeError(f"the engine finished without outputs for requests {missing}.")
        return [finished[rid] for rid in request_ids]

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()


class _PoolingTracker:
    """The finished pooling outputs of one embed/encode call, what is still in flight, and the
    progress bar."""

    def __init__(self, router: OutputRouter, sink: Sink, total: int, use_tqdm: UseTqdm, timeout: Optional[float] = None) -> None:
        self.router = router
        self.sink = sink
        self.timeout = timeout
        self.finished: dict[str, PoolingRequestOutput] = {}
        self.in_flight = 0
        self.started = time.perf_counter()
        self.prompt_tokens = 0
        self.bar = _progress_bar(total, use_tqdm) if use_tqdm and total > 1 else None

    def collect(self) -> None:
        """Takes one batch of engine outputs (blocks until it comes)."""
        done = 0
        for output in self.router.next_outputs(self.sink, self.timeout):
            if not isinstance(output, PoolingRequestOutput):
                continue
            self.finished[output.request_id] = output
            num_tokens = len(output.prompt_token_ids)
            self.in_flight -= 1
            self.prompt_tokens += num_tokens
            done += 1
            if output.error is not None:
                logger.warning("request %s failed in the engine: %s", output.request_id, output.error)
        if self.bar is not None and done:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"est. speed input: {self.prompt_tokens / elapsed:.1f} toks/s")
            self.bar.update(done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elapsed = time.perf_counter() - self.started
        logger.info(
            "%d pooling requests: %d prompt tokens in %.2f s (%.1f requests/s)",
            len(self.finished), self.prompt_tokens, elapsed, len(self.finished) / max(elapsed, 1e-9),
        )


def _pooling_params_per_prompt(pooling_params: PoolingParamsArg, num_prompts: int) -> list[PoolingParams]:
    if pooling_params is None:
        return [PoolingParams()] * num_prompts
    if isinstance(pooling_params, SamplingParams):
        raise TypeError("pooling_params must be a PoolingParams, got SamplingParams; use generate() to generate.")
    return params_per_prompt(pooling_params, num_prompts, PoolingParams, "pooling_params")


def _progress_bar(total: int, use_tqdm: UseTqdm = True) -> Any:
    """use_tqdm: True, or (as vLLM allows) a callable that makes the bar, e.g. partial(tqdm, leave=False)."""
    from tqdm.auto import tqdm

    make = use_tqdm if callable(use_tqdm) else tqdm
    return make(total=total, desc="Processed prompts", dynamic_ncols=True)


def _with_truncation(tokenization_kwargs: Optional[dict[str, Any]], truncate_prompt_tokens: Optional[int]) -> Optional[dict[str, Any]]:
    if truncate_prompt_tokens is None:
        return tokenization_kwargs
    return {**(tokenization_kwargs or {}), "truncate_prompt_tokens": truncate_prompt_tokens}


def _pooling_truncation(tokenization_kwargs: Optional[dict[str, Any]], params_list: list[PoolingParams]) -> Optional[dict[str, Any]]:
    """The call's tokenization kwargs with the PoolingParams' truncate_prompt_tokens (one value per call)."""
    values = {p.truncate_prompt_tokens for p in params_list} - {None}
    if not values:
        return tokenization_kwargs
    if len(values) > 1:
        raise ValueError(f"pooling_params ask for different truncate_prompt_tokens {sorted(values)}: give one per call.")
    return _with_truncation(tokenization_kwargs, values.pop())
