"""Beam search over `LLM.generate`, as vLLM's `LLM.beam_search` does it: each step asks every
live beam for its next token's 2 x beam_width most likely tokens (one-token requests, which the
prefix cache makes cheap), and keeps the beam_width best candidates by
cumulative logprob / length ** length_penalty (length counts the prompt, and a final EOS does not)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from shmvllm.logprobs import Logprob
from shmvllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from shmvllm.entrypoints.llm import LLM


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's then the generated ones; `text` decodes all of them."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: None = None
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    multi_modal_data: None = None
    mm_processor_kwargs: None = None


@dataclass
class BeamSearchOutput:
    """The beam_width best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class BeamSearchInstance:
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(seq: BeamSearchSequence, eos_token_id: Optional[int], length_penalty: float) -> float:
    length = len(seq.tokens) - (1 if eos_token_id is not None and seq.tokens[-1] == eos_token_id else 0)
    return seq.cum_logprob / (length**length_penalty)


def run_beam_search(llm: "LLM", prompt_ids: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    max_len = llm.llm_engine.model_config.max_model_len
    step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature)
    instances = [BeamSearchInstance([BeamSearchSequence(tokens=list(ids), logprobs=[])]) for ids in prompt_ids]

    def key(seq: BeamSearchSequence) -> float:
        return beam_score(seq, eos, params.length_penalty)

    for _ in range(params.max_tokens):
        live = [(inst, beam) for inst in instances for beam in inst.beams]
        if not live:
            break
        for inst, beam in live:  # a beam that filled the context is done
            if len(beam.tokens) >= max_len:
                inst.completed.append(beam)
        live = [(inst, beam) for inst, beam in live if len(beam.tokens) < max_len]
        outputs = llm.generate([{"prompt_token_ids": beam.tokens} for _, beam in live], step_params, use_tqdm=False)
        candidates: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
        for (inst, beam), output in zip(live, outputs):
            top = output.outputs[0].logprobs[0]
            for token_id, logprob in top.items():
                new = BeamSearchSequence(
                    tokens=beam.tokens + [token_id],
                    logprobs=beam.logprobs + [top],
                    cum_logprob=beam.cum_logprob + logprob.logprob,
                )
                if token_id == eos and not params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", eos
                    inst.completed.append(new)
                else:
                    candidates[id(inst)].append(new)
        for inst in instances:
            inst.beams = sorted(candidates[id(inst)], key=key, reverse=True)[: params.beam_width]

    results = []
    for inst in instances:
        best = sorted(inst.completed + inst.beams, key=key, reverse=True)[: params.beam_width]
        for seq in best:
            seq.text = tokenizer.decode(seq.tokens)
            seq.finish_reason = seq.finish_reason or "length"
        results.append(BeamSearchOutput(sequences=best))
    return results


def beam_prompt_ids(llm: "LLM", prompts: list[Any]) -> list[list[int]]:
    """Token ids of each prompt (text is tokenized as generate() would)."""
    processor = llm.llm_engine.input_processor
    return [processor.tokenize_prompt(p)[1] for p in prompts]
