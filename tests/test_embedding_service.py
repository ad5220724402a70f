"""examples/embedding_service.py under uvicorn: 64 concurrent HTTP requests from httpx, each
answered with exactly what LLM.embed / LLM.generate give for it (marker apps: needs the apps extra)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.apps
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from shmvllm import LLM, SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NUM_REQUESTS = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def service(tiny_bert_dir, tiny_llama_dir):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "embedding_service.py"), "--port", str(port),
         "--embed-model", str(tiny_bert_dir), "--generate-model", str(tiny_llama_dir), "--max-model-len", "256"],
        env=env, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            httpx.get(url + "/docs", timeout=1)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_64_concurrent_requests_each_get_their_answer(service, tiny_bert_dir, tiny_llama_dir):
    texts = [f"sentence number {i} about shared memory rings" for i in range(NUM_REQUESTS // 2)]
    prompts = [f"prompt {i} once upon a time" for i in range(NUM_REQUESTS // 2)]
    with LLM(str(tiny_bert_dir)) as llm:
        ref_vectors = [o.outputs.numpy() for o in llm.embed(texts, use_tqdm=False)]
    with LLM(str(tiny_llama_dir), max_model_len=256) as llm:
        ref_ids = [list(o.outputs[0].token_ids) for o in llm.generate(
            prompts, [SamplingParams(temperature=0, max_tokens=4 + i % 9) for i in range(len(prompts))], use_tqdm=False)]

    async def main():
        async with httpx.AsyncClient(base_url=service, timeout=120) as client:
            embeds = [client.post("/v1/embeddings", json={"input": t}) for t in texts]
            completions = [
                client.post("/v1/completions", json={"prompt": p, "max_tokens": 4 + i % 9, "stream": i % 2 == 1})
                for i, p in enumerate(prompts)
            ]
            return await asyncio.gather(*embeds, *completions)

    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    for r, ref in zip(responses[: len(texts)], ref_vectors):
        np.testing.assert_allclose(np.array(r.json()["data"][0]["embedding"], dtype=np.float32), ref, atol=1e-5)
    for i, (r, ref) in enumerate(zip(responses[len(texts) :], ref_ids)):
        if i % 2 == 1:
            events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            ids = [t for e in events[:-1] for t in json.loads(e)["token_ids"]]
        else:
            ids = r.json()["choices"][0]["token_ids"]
        assert ids == ref, i


def test_bad_input_is_a_400_and_the_service_goes_on(service):
    bad = httpx.post(service + "/v1/completions", json={"prompt": "hi", "max_tokens": -3}, timeout=60)
    assert bad.status_code == 400 and "max_tokens" in bad.text
    good = httpx.post(service + "/v1/embeddings", json={"input": ["a", "b"]}, timeout=60)
    assert good.status_code == 200 and len(good.json()["data"]) == 2
