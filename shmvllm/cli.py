"""The `shmvllm` command: `generate`, `chat`, `embed` (and further subcommands registered in SUBCOMMANDS).

Results go to stdout; logs go to stderr (warnings only, unless -v).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Callable, Optional, Sequence

from shmvllm.model.registry import DEFAULT_MODEL

# Each entry adds one subcommand to the parser: it calls `subparsers.add_parser(...)` and sets
# `func=<callable(args) -> int>` with set_defaults. Further subcommands (embed, bench) go here.
SubcommandAdder = Callable[[Any], None]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=DEFAULT_MODEL,
        help=f"model to load: a shipped short name ({DEFAULT_MODEL}, all-minilm-l6-v2), a local Hugging Face "
        "model directory, or a .gguf file (default: %(default)s)",
    )
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                       help="weight and activation dtype; auto: float32 on CPU, bf16/fp16 on CUDA (default: %(default)s)")
    group.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto picks CUDA when present (default: %(default)s)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's limit)")
    group.add_argument("--inproc", action="store_true",
                       help="run the engine in this process instead of its own process (for debugging)")
    group.add_argument("-v", "--verbose", action="store_true", help="log loading, progress and throughput to stderr")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int, max_tokens_why: str = "") -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help=f"most tokens to generate (default: %(default)s{max_tokens_why})")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature; 0 is greedy, which makes the output deterministic (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                       "whose probability adds up to this, in (0, 1] (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=-1, help="keep only the k most likely tokens; -1 keeps all (default: %(default)s)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens less likely than this fraction of the most likely one (default: %(default)s)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="above 1 discourages repeating tokens of the prompt and output (default: %(default)s)")
    group.add_argument("--seed", type=int, default=None, help="sampling seed, for repeatable sampled output (default: none)")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop when this text is generated (not included in the output); repeatable")
    group.add_argument("--system", default=None, metavar="TEXT",
                       help="system message for the chat template (default: the template's own)")


def sampling_params_from_args(args: argparse.Namespace, **overrides: Any) -> Any:
    from shmvllm.sampling_params import SamplingParams

    values = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
    )
    values.update(overrides)
    return SamplingParams(**values)


def make_llm(args: argparse.Namespace, **engine_args: Any) -> Any:
    from shmvllm.entrypoints.llm import LLM

    return LLM(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               multiprocess=not args.inproc, **engine_args)


def conversation(args: argparse.Namespace, prompt: str) -> list[dict[str, str]]:
    system = [{"role": "system", "content": args.system}] if args.system else []
    return system + [{"role": "user", "content": prompt}]


# --- generate -----------------------------------------------------------------------------------


def add_generate_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate", help="complete one or more prompts and print the results",
        description="Complete each PROMPT and print the generated text. For a model with a chat template "
        "(an instruct model), each prompt is sent as a user message through the template, so that a question "
        "gets an answer; --no-chat-template sends the raw text for plain completion.",
    )
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to complete (several: one request each)")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt (default: %(default)s)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="send the prompt as raw text, without the model's chat template")
    parser.add_argument("--stream", action="store_true",
                        help="print the text as it is generated, prompt after prompt (needs --n 1)")
    add_sampling_args(parser, max_tokens=16, max_tokens_why=", vLLM's default for a completion")
    add_engine_args(parser)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    if args.stream:
        return run_generate_streaming(args)
    params = sampling_params_from_args(args, n=args.n)
    with make_llm(args) as llm:
        use_template = not args.no_chat_template and llm.llm_engine.renderer.has_chat_template
        if use_template:
            outputs = llm.chat([conversation(args, p) for p in args.prompts], params, use_tqdm=False)
        else:
            outputs = llm.generate(list(args.prompts), params, use_tqdm=False)
    labelled = len(outputs) > 1 or args.n > 1
    for i, output in enumerate(outputs):
        for completion in output.outputs:
            if labelled:
                print(f"--- prompt {i}, completion {completion.index} ---")
            print(completion.text)
        if output.error:
            print(f"error: {output.error}", file=sys.stderr)
    return 1 if any(o.error for o in outputs) else 0


def run_generate_streaming(args: argparse.Namespace) -> int:
    from shmvllm.sampling_params import RequestOutputKind

    if args.n != 1:
        raise SystemExit(f"shmvllm generate: error: --stream prints one completion per prompt; got --n {args.n}.")
    params = sampling_params_from_args(args, output_kind=RequestOutputKind.DELTA)
    failed = False
    with make_llm(args) as llm:
        renderer = llm.llm_engine.renderer
        use_template = not args.no_chat_template and renderer.has_chat_template
        for i, text in enumerate(args.prompts):
            if len(args.prompts) > 1:
                print(f"--- prompt {i}, completion 0 ---", flush=True)
            if use_template:
                rendered, ids = renderer.render_chat(conversation(args, text))
                prompt: Any = {"prompt": rendered, "prompt_token_ids": ids}
            else:
                prompt = text
            _, error = stream_prompt(llm, prompt, params)
            failed = failed or error
    return 1 if failed else 0


# --- chat ---------------------------------------------------------------------------------------


def add_chat_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chat", help="talk to the model in a read-eval-print loop",
        description="A chat in the terminal through the model's chat template. Each reply is printed as it is "
        "generated. Type /reset to start a new conversation, /exit (or Ctrl-D) to quit; Ctrl-C stops a reply.",
    )
    add_sampling_args(parser, max_tokens=512)
    add_engine_args(parser)
    parser.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    from shmvllm.sampling_params import RequestOutputKind

    params = sampling_params_from_args(args, output_kind=RequestOutputKind.DELTA)
    interactive = sys.stdin.isatty()
    with make_llm(args) as llm:
        history: list[dict[str, str]] = conversation(args, "")[:-1]
        while True:
            line = _read_line("> " if interactive else "")
            if line is None or line.strip() == "/exit":
                return 0
            if line.strip() == "/reset":
                history = conversation(args, "")[:-1]
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply = stream_reply(llm, history, params)
            history.append({"role": "assistant", "content": reply})


def stream_reply(llm: Any, history: list[dict[str, str]], params: Any) -> str:
    """Generates the assistant's next message, printing each piece as it arrives."""
    text, ids = llm.llm_engine.renderer.render_chat(history)
    reply, _ = stream_prompt(llm, {"prompt": text, "prompt_token_ids": ids}, params)
    return reply


def stream_prompt(llm: Any, prompt: Any, params: Any) -> tuple[str, bool]:
    """Generates one completion (params with output_kind DELTA), printing each piece as it
    arrives; Ctrl-C stops it. Returns the text and whether the engine reported an error."""
    engine = llm.llm_engine
    request_id = f"stream-{next(llm.request_counter)}"
    engine.add_request(request_id, prompt, params)
    pieces = []
    error = False
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                for completion in output.outputs:
                    pieces.append(completion.text)
                    print(completion.text, end="", flush=True)
                if output.error:
                    error = True
                    print(f"\nerror: {output.error}", file=sys.stderr)
    except KeyboardInterrupt:
        engine.abort_request([request_id])
    print(flush=True)
    return "".join(pieces), error


def _read_line(prompt: str) -> Optional[str]:
    try:
        return input(prompt)
    except EOFError:
        return None


# --- embed --------------------------------------------------------------------------------------

EMBED_DEFAULT_MODEL = "all-minilm-l6-v2"


def add_embed_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "embed", help="embed texts and print one JSON line per text",
        description="Embed each TEXT (or each line of --input) with an embedding model and print one JSON "
        'object per text, in input order: {"index": i, "text": ..., "embedding": [...]}. Texts longer than '
        "the model's max length are truncated, as sentence-transformers does.",
    )
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="text to embed (several: one request each)")
    parser.add_argument("--input", metavar="FILE", help="read the texts from FILE, one per line ('-': stdin)")
    parser.add_argument("--dimensions", type=int, default=None,
                        help="keep only the first N values (Matryoshka truncation), renormalized (default: all)")
    parser.add_argument("--no-normalize", action="store_true", help="print the pooled vector without L2 normalization")
    add_engine_args(parser)
    parser.set_defaults(func=run_embed, model=EMBED_DEFAULT_MODEL)


def read_texts(args: argparse.Namespace) -> list[str]:
    texts = list(args.texts)
    if args.input is not None:
        if args.input == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(args.input, encoding="utf-8") as f:
                lines = f.read().splitlines()
        texts += lines
    if not texts:
        raise ValueError("nothing to embed: give TEXT arguments or --input FILE.")
    return texts


def run_embed(args: argparse.Namespace) -> int:
    from shmvllm.pooling_params import PoolingParams

    texts = read_texts(args)
    params = PoolingParams(dimensions=args.dimensions, normalize=False if args.no_normalize else None)
    with make_llm(args, task="embed") as llm:
        outputs = llm.embed(texts, params, use_tqdm=args.verbose)
    for i, (text, output) in enumerate(zip(texts, outputs)):
        record: dict[str, Any] = {"index": i, "text": text, "embedding": output.outputs.embedding}
        if output.error:
            record["error"] = output.error
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    sys.stdout.flush()
    return 1 if any(o.error for o in outputs) else 0


SUBCOMMANDS: list[SubcommandAdder] = [add_generate_parser, add_chat_parser, add_embed_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmvllm",
        description="Offline LLM inference with vLLM v1's architecture over shared-memory rings.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def run() -> None:
    """The `shmvllm` command: `main`, then the process ends without the interpreter's teardown
    (0.3 s of freeing transformers' modules and the tokenizer's objects, once the engine is shut
    down and the output flushed; an exception still exits the usual way, with its traceback)."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"shmvllm: error: {exc}", file=sys.stderr)
        return 2
