"""A small HTTP service on shmvllm: every request of every client goes into one shared engine per model.

    pip install 'shmvllm[apps]'
    python examples/embedding_service.py --port 8000
    curl -s localhost:8000/v1/embeddings -d '{"input": ["hello", "world"]}'
    curl -s localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'
    curl -sN localhost:8000/v1/completions -d '{"prompt": "Once upon a time", "stream": true}'

Concurrent HTTP requests become concurrent AsyncLLM requests: the engine batches them into
shared steps (continuous batching), so throughput grows with the number of clients instead of
queueing behind a lock. A client that disconnects from a stream aborts its request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import uuid
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from shmvllm import AsyncLLM, EngineArgs, SamplingParams
from shmvllm.sampling_params import RequestOutputKind


class EmbeddingRequest(BaseModel):
    input: Union[str, list[str]]


class CompletionRequest(BaseModel):
    prompt: str
    max_tokens: int = 16
    temperature: float = 0.0
    stream: bool = False


def create_app(embed_model: Optional[str], generate_model: Optional[str], **engine_args: Any) -> FastAPI:
    """The service; a model left out (None or "") disables its endpoint."""
    engines: dict[str, AsyncLLM] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            if embed_model:
                engines["embed"] = AsyncLLM.from_engine_args(EngineArgs(model=embed_model, **engine_args))
            if generate_model:
                engines["generate"] = AsyncLLM.from_engine_args(EngineArgs(model=generate_model, **engine_args))
            yield
        finally:
            for engine in engines.values():
                engine.shutdown()

    app = FastAPI(title="shmvllm embedding service", lifespan=lifespan)

    def engine_for(task: str) -> AsyncLLM:
        if task not in engines:
            raise HTTPException(404, f"this service has no {task} model.")
        return engines[task]

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest) -> dict[str, Any]:
        engine = engine_for("embed")
        texts = [request.input] if isinstance(request.input, str) else request.input
        try:
            outputs = [await engine.embed(text) for text in texts]
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": o.outputs.embedding} for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs)},
        }

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> Any:
        engine = engine_for("generate")
        try:
            params = SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                                    output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY)
        except (ValueError, TypeError) as exc:
            raise HTTPException(400, str(exc)) from exc
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = engine.generate(request.prompt, params, request_id)
        try:
            first = await stream.__anext__()  # a bad prompt fails here, as a 400, before any byte is sent
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        if not request.stream:
            completion = first.outputs[0]
            return {"id": request_id, "object": "text_completion",
                    "choices": [{"index": 0, "text": completion.text, "token_ids": list(completion.token_ids),
                                 "finish_reason": completion.finish_reason}]}

        async def events() -> AsyncIterator[str]:
            try:
                output = first
                while True:
                    completion = output.outputs[0]
                    yield "data: " + json.dumps({"id": request_id, "text": completion.text,
                                                 "token_ids": list(completion.token_ids),
                                                 "finish_reason": completion.finish_reason}) + "\n\n"
                    if output.finished:
                        break
                    output = await stream.__anext__()
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()  # a client gone mid-stream aborts the request

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--embed-model", default=os.environ.get("SHMVLLM_EMBED_MODEL", "all-minilm-l6-v2"),
                        help="embedding model ('' for none; default: %(default)s)")
    parser.add_argument("--generate-model", default=os.environ.get("SHMVLLM_GENERATE_MODEL", "smollm2-135m-instruct"),
                        help="generation model ('' for none; default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args()
    engine_args = {} if args.max_model_len is None else {"max_model_len": args.max_model_len}
    uvicorn.run(create_app(args.embed_model, args.generate_model, **engine_args), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
