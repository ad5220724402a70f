"""async_scheduling=True (vLLM's AsyncScheduler: step N+1 scheduled while step N runs, with a
placeholder for each token not yet known): the same tokens as without it, greedy and seeded,
through preemption, chunked prefill and prefix-cache hits; refused by name where it does not apply."""

from __future__ import annotations

import pytest

from shmvllm import LLM, SamplingParams
from shmvllm.core.sched.scheduler import Scheduler
from test_engine_core import MIXED_LENGTHS, random_prompts

pytestmark = pytest.mark.usefixtures("no_engine_left_behind")


def _params(eos: int) -> list[SamplingParams]:
    """One per prompt: greedy of several lengths (1 token: the request ends while its next step
    is already scheduled), seeded sampling, n=2, penalties, min_tokens, stop ids, logprobs."""
    return [
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=12, eos_token_id=eos),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10),
        SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, seed=3, min_tokens=6, max_tokens=8, stop_token_ids=[5, 9, 17]),
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=2),
        SamplingParams(temperature=0.7, seed=5, max_tokens=11, presence_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=4),
    ]


def _generate(model_dir, async_scheduling: bool, prompts, params, monkeypatch=None, **engine_args):
    """Each output's (token ids, finish reason, logprobs), and the engine's stats after the run."""
    with LLM(str(model_dir), multiprocess=False, async_scheduling=async_scheduling, max_model_len=256,
             **engine_args) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.engine_core.get_stats()
    got = [
        [(list(c.token_ids), c.finish_reason, [sorted(d) for d in c.logprobs or []]) for c in o.outputs]
        for o in outputs
    ]
    return got, stats


@pytest.fixture
def most_placeholders(monkeypatch):
    """The most placeholders any request held at a schedule: 2 means a step was scheduled
    while the one before it had not given its tokens yet."""
    seen = [0]
    original = Scheduler.schedule

    def schedule(self):
        output = original(self)
        seen[0] = max([seen[0], *(r.num_output_placeholders for r in self.requests.values())])
        return output

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    return seen


@pytest.mark.parametrize("case, engine_args", [
    ("plain", dict(num_kv_blocks=128)),
    ("preemption", dict(num_kv_blocks=24, block_size=4)),
    ("chunked prefill", dict(num_kv_blocks=128, max_num_batched_tokens=16)),
])
def test_async_scheduling_gives_the_same_tokens(tiny_llama_dir, most_placeholders, case, engine_args):
    prompts = random_prompts(MIXED_LENGTHS, seed=5)
    if case == "chunked prefill":  # and prefix-cache hits: a shared 40-token system prompt
        system = random_prompts([40], seed=6)[0]
        prompts = [system + p for p in prompts]
    from test_engine_core import eos_of

    params = _params(eos_of(tiny_llama_dir))
    expected, _ = _generate(tiny_llama_dir, False, prompts, params, **engine_args)
    assert most_placeholders[0] == 0
    got, stats = _generate(tiny_llama_dir, True, prompts, params, **engine_args)
    assert most_placeholders[0] == 2  # steps did overlap
    assert got == expected
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]  # every block back, placeholders and all
    if case == "preemption":
        assert stats["num_preemptions"] > 0
    if case == "chunked prefill":
        assert stats["prefix_cache_hits"] > 0


def test_async_scheduling_in_the_engine_process(tiny_llama_dir):
    prompts = random_prompts([3, 17, 8, 30], seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=9), SamplingParams(temperature=1.0, seed=2, max_tokens=12)] * 2
    with LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    with LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, async_scheduling=True) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        assert llm.llm_engine.engine_core.get_stats()["num_free_blocks"] == 64
    assert got == expected


@pytest.mark.parametrize("extra, error, match", [
    (dict(async_scheduling="yes"), TypeError, "async_scheduling must be .*bool.*got 'yes'"),
    (dict(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     ValueError, "async_scheduling=True is not supported with speculative_config"),
])
def test_async_scheduling_refused_where_it_does_not_apply(tiny_llama_dir, extra, error, match):
    with pytest.raises(error, match=match):
        LLM(str(tiny_llama_dir), max_model_len=256, **extra)


def test_async_scheduling_is_for_generation(minilm_dir):
    with pytest.raises(ValueError, match="async_scheduling=True applies to generation"):
        LLM(str(minilm_dir), async_scheduling=True)


def test_structured_outputs_step_one_at_a_time_and_give_the_same_tokens():
    import re

    from shmvllm.sampling_params import StructuredOutputsParams

    prompts = ["Is the sky blue? Answer yes or no.", "In which year did the war end?", "Tell me about cats."]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"[12][0-9]{3}")),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    runs = []
    for flag in (False, True):
        with LLM(max_model_len=256, multiprocess=False, async_scheduling=flag) as llm:
            runs.append([o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[1] == runs[0]
    assert runs[1][0] in ("yes", "no") and re.fullmatch(r"[12][0-9]{3}", runs[1][1])
