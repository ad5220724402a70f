"""SpeculativeConfig: vLLM's `speculative_config` dict, checked at the API boundary.

Two methods are implemented: 'ngram' (prompt lookup) and 'draft_model' (a small model of the
target's tokenizer, run by the same worker). Every other method vLLM knows is refused by name,
and so is every key this engine would otherwise ignore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

_REFUSED_METHODS = {
    "eagle": "EAGLE heads", "eagle3": "EAGLE-3 heads", "medusa": "Medusa heads", "mlp_speculator": "MLP speculators",
    "mtp": "multi-token-prediction layers", "deepseek_mtp": "multi-token-prediction layers",
    "suffix": "suffix decoding",
}
_METHODS = ("ngram", "draft_model")
# Keys of vLLM's SpeculativeConfig that change nothing at their default, per method.
_DEFAULT_ONLY = {
    "ngram": {
        "model": None, "draft_tensor_parallel_size": None, "quantization": None, "max_model_len": None,
        "revision": None, "code_revision": None, "disable_padded_drafter_batch": False,
    },
    "draft_model": {
        "max_model_len": None, "revision": None, "code_revision": None, "disable_padded_drafter_batch": False,
        "prompt_lookup_max": None, "prompt_lookup_min": None,
    },
}


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 5  # the longest suffix n-gram matched
    prompt_lookup_min: int = 3  # the shortest: shorter matches mostly propose what is rejected
    model: Optional[str] = None  # draft_model: what the user named
    quantization: Optional[str] = None  # draft_model: the draft's own `quantization` (EngineConfig.draft_model_config)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_user(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """`LLM(speculative_config=...)`: None, a dict of vLLM's keys, or a SpeculativeConfig."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict or None, got {type(value).__name__}: {value!r}.")
        options = dict(value)
        method = options.pop("method", None)
        if method is None and options.get("model") in ("ngram", "[ngram]"):
            method = "ngram"  # vLLM's older spelling: model="[ngram]"
            options.pop("model")
        if method is None:
            raise ValueError("speculative_config['method'] is required ('ngram' or 'draft_model').")
        if method in _REFUSED_METHODS:
            raise ValueError(
                f"speculative_config['method']={method!r} is not supported: {_REFUSED_METHODS[method]} are not "
                "implemented (only 'ngram', prompt lookup, and 'draft_model' are)."
            )
        if method not in _METHODS:
            raise ValueError(f"speculative_config['method']={method!r} is unknown ('ngram' or 'draft_model').")
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config['num_speculative_tokens'] is required.")
        k = _positive_int(options.pop("num_speculative_tokens"), "num_speculative_tokens", 64)
        for key, default in _DEFAULT_ONLY[method].items():
            if key in options and options[key] != default:
                raise ValueError(f"speculative_config[{key!r}]={value[key]!r} is not supported with method {method!r}.")
            options.pop(key, None)
        if method == "draft_model":
            config = cls._draft_model(options, k)
        else:
            config = cls._ngram(options, k)
        if options:
            key = sorted(options)[0]
            raise ValueError(f"speculative_config[{key!r}]={options[key]!r} is not supported.")
        return config

    @classmethod
    def _ngram(cls, options: dict[str, Any], k: int) -> "SpeculativeConfig":
        n_max = options.pop("prompt_lookup_max", None)
        n_min = options.pop("prompt_lookup_min", None)
        n_max = _positive_int(n_max, "prompt_lookup_max", 1024) if n_max is not None else None
        n_min = _positive_int(n_min, "prompt_lookup_min", 1024) if n_min is not None else None
        # one bound given sets the other to it (as vLLM); neither: 3..5 (benchmarks/results/speculative.md)
        if n_max is None and n_min is None:
            n_max, n_min = cls.prompt_lookup_max, cls.prompt_lookup_min
        elif n_max is None:
            n_max = n_min
        elif n_min is None:
            n_min = n_max
        if n_min > n_max:
            raise ValueError(
                f"speculative_config['prompt_lookup_min']={n_min} must not exceed prompt_lookup_max={n_max}."
            )
        return cls(method="ngram", num_speculative_tokens=k, prompt_lookup_max=n_max, prompt_lookup_min=n_min)

    @classmethod
    def _draft_model(cls, options: dict[str, Any], k: int) -> "SpeculativeConfig":
        model = options.pop("model", None)
        if model is None:
            raise ValueError("speculative_config['model'] is required with method 'draft_model'.")
        if not isinstance(model, str) or not model:
            raise TypeError(f"speculative_config['model'] must be a non-empty str, got {model!r}.")
        tp = options.pop("draft_tensor_parallel_size", None)
        if tp is not None and tp != 1:
            raise ValueError(
                f"speculative_config['draft_tensor_parallel_size']={tp!r} is not supported: the draft runs on one rank (1)."
            )
        quantization = options.pop("quantization", None)
        if quantization is not None and not isinstance(quantization, str):
            raise TypeError(f"speculative_config['quantization'] must be a str or None, got {quantization!r}.")
        return cls(method="draft_model", num_speculative_tokens=k, model=model, quantization=quantization)


def _positive_int(value: Any, name: str, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"speculative_config[{name!r}] must be an int, got {type(value).__name__}: {value!r}.")
    if not 1 <= value <= limit:
        raise ValueError(f"speculative_config[{name!r}] must be in [1, {limit}], got {value}.")
    return value


def samples_independently(params: Any) -> bool:
    """Whether a request's sampling at a later position is independent of the outputs before it
    (no penalties, no bad_words): only such a request can have proposals verified in one pass."""
    return not (
        params.bad_words_token_ids or params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )


def draft_may_propose(params: Any) -> bool:
    """Whether a draft model's proposals may be verified for this request. Not for random
    sampling under a grammar: the scheduler cuts proposals at the first token the grammar
    forbids, a cut that depends on the draws from q and would bias rejection sampling (an
    n-gram's point mass is unaffected: a forbidden x has p(x) = 0 and is rejected anyway)."""
    return params.structured_outputs is None or params.temperature < 1e-5
