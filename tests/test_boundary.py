"""The frontend<->engine boundary: validation against READY's limits, request-id reservation."""

from __future__ import annotations

import pytest

from shmvllm import LLM, SamplingParams

BLOCK_SIZE = 16
SMALL_CACHE_BLOCKS = 8  # 128 tokens, under max_model_len=256


def _engine_queue(llm: LLM) -> tuple[int, int]:
    stats = llm.llm_engine.engine_core.get_stats()
    return stats["num_running_reqs"], stats["num_waiting_reqs"]


@pytest.fixture(scope="module", params=[False, True], ids=["inproc", "multiprocess"])
def small_cache_llm(request, tiny_llama_dir):
    with LLM(
        model=str(tiny_llama_dir), multiprocess=request.param, max_model_len=256,
        num_kv_blocks=SMALL_CACHE_BLOCKS, block_size=BLOCK_SIZE,
    ) as llm:
        yield llm


def test_ready_carries_the_clamped_max_model_len(small_cache_llm):
    ready = small_cache_llm.llm_engine.engine_core.ready
    assert ready.max_model_len == SMALL_CACHE_BLOCKS * BLOCK_SIZE < 256
    assert small_cache_llm.llm_engine.input_processor.max_model_len == ready.max_model_len


def test_prompt_longer_than_the_kv_cache_raises_before_anything_is_queued(small_cache_llm):
    llm = small_cache_llm
    cache_tokens = SMALL_CACHE_BLOCKS * BLOCK_SIZE
    too_long = {"prompt_token_ids": [7] * (cache_tokens + 10)}  # fits max_model_len=256, not the cache
    with pytest.raises(ValueError, match=f"max_model_len={cache_tokens}"):
        llm.generate(too_long, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 4}, too_long], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert _engine_queue(llm) == (0, 0)
    out = llm.generate(
        {"prompt_token_ids": [5] * (cache_tokens - 8)}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"


def test_duplicate_request_ids_are_refused_before_anything_is_queued(small_cache_llm):
    engine = small_cache_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request("a", [5, 6, 7], params)
    # a child id of an n > 1 request that an n = 1 request already holds
    engine.add_request("0_b", [5, 6], params)
    with pytest.raises(ValueError, match="child request id '0_b'.*in use by request '0_b'"):
        engine.add_request("b", [5, 6], SamplingParams(n=2, seed=1, max_tokens=2, ignore_eos=True))
    # and the other way round: an n = 1 request whose id a live child holds
    engine.add_request("c", [5, 6], SamplingParams(n=2, seed=1, max_tokens=2, ignore_eos=True))
    with pytest.raises(ValueError, match="'1_c' is already in use"):
        engine.add_request("1_c", [5, 6], params)
    assert sorted(engine.output_processor.request_states) == ["0_b", "0_c", "1_c", "a"]
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["0_b", "a", "c"]
    assert len(finished["c"].outputs) == 2 and all(o.error is None for o in finished.values())
    assert _engine_queue(small_cache_llm) == (0, 0)
    # every id is free again once its request finished
    engine.add_request("b", [5, 6], SamplingParams(n=2, seed=1, max_tokens=2, ignore_eos=True))
    engine.abort_request(["b"])
    assert not engine.has_unfinished_requests()
