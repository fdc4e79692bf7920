"""``posttrain generate --model DIR --prompts FILE -o OUT.jsonl``: sample completions for a file of prompts.

Prompts file: ``.jsonl`` with one object per line holding ``prompt`` (a string or a list of messages) or
``messages`` (a chat), and optionally ``id`` (default: the line number); or any other file with one raw
prompt per line. Chats get the model's chat template; with ``--chat`` plain-string prompts are sent as a
user turn too. Output: one line per prompt ``{"id", "prompt", "output", "completions": [{"text",
"finish_reason", "num_tokens"}]}`` where ``output`` is the first completion — the format
``posttrain eval --outputs`` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from posttrain.data.errors import DataError
from posttrain.data.records import Message


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="Sample completions from a model for a file of prompts (HF backend; vLLM on GPU).",
        description=__doc__.split("\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="HF-format model directory")
    parser.add_argument("--prompts", required=True, help=".jsonl (prompt / messages / id) or one prompt per line")
    parser.add_argument("-o", "--output", required=True, help="output JSONL")
    add_sampling_arguments(parser, default_temperature=1.0)
    parser.add_argument("--chat", action="store_true", help="send plain-string prompts as a user turn (chat template)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_generate)


def add_sampling_arguments(parser: argparse.ArgumentParser, default_temperature: float,
                           default_max_new_tokens: int = 128) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                       help="hf works everywhere; vllm needs a GPU and `pip install 'posttrain[vllm]'`")
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
        return get_backend("vllm", model_path=args.model, dtype=args.dtype)
    return get_backend("hf", model_path=args.model, dtype=args.dtype, device=args.device)


def read_prompts(path: str | Path) -> list[tuple[str, str | list[Message]]]:
    """(id, prompt) pairs; every line is used or rejected with its line number."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    prompts: list[tuple[str, str | list[Message]]] = []
    if path.suffix != ".jsonl":
        return [(str(number), line) for number, line in enumerate(lines, start=1) if line.strip()]
    seen: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DataError(str(path), number, None, f"not valid JSON: {exc.msg}") from None
        if not isinstance(data, dict):
            raise DataError(str(path), number, None, "each line must be a JSON object")
        prompt = data.get("prompt", data.get("messages"))
        if prompt is None:
            raise DataError(str(path), number, "prompt", "needs `prompt` (string or messages) or `messages`")
        if isinstance(prompt, list):
            try:
                prompt = [Message.model_validate(m) for m in prompt]
            except ValueError as exc:
                raise DataError(str(path), number, "prompt", f"not a list of messages: {exc}") from None
            if prompt and prompt[-1].role == "assistant":
                raise DataError(str(path), number, "prompt", "the last message is an assistant turn; nothing to answer")
        elif not isinstance(prompt, str) or not prompt.strip():
            raise DataError(str(path), number, "prompt", "must be a non-empty string or a list of messages")
        key = str(data.get("id", number))
        if key in seen:
            raise DataError(str(path), number, "id", f"duplicate id {key!r}")
        seen.add(key)
        prompts.append((key, prompt))
    return prompts


def _generate(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    prompts = read_prompts(args.prompts)
    if not prompts:
        print(f"posttrain generate: {args.prompts}: no prompts", file=sys.stderr)
        return 2
    try:
        backend = backend_from_args(args)
    except ImportError as exc:  # an optional backend that is not installed: the message says what to do
        print(f"posttrain generate: {exc}", file=sys.stderr)
        return 2
    inputs = [[Message(role="user", content=p)] if args.chat and isinstance(p, str) else p for _, p in prompts]
    started = time.perf_counter()
    results = backend.generate(inputs, params, batch_size=args.batch_size, progress=not args.quiet)
    elapsed = time.perf_counter() - started
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = 0
    with open(out, "w", encoding="utf-8") as handle:
        for (key, prompt), completions in zip(prompts, results, strict=True):
            tokens += sum(len(c.token_ids) for c in completions)
            record = {
                "id": key,
                "prompt": prompt if isinstance(prompt, str) else [m.model_dump() for m in prompt],
                "output": completions[0].text,
                "completions": [
                    {"text": c.text, "finish_reason": c.finish_reason, "num_tokens": len(c.token_ids)}
                    for c in completions
                ],
            }
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{len(prompts)} prompts x {params.n} samples, {tokens} tokens in {elapsed:.1f}s "
          f"({tokens / max(elapsed, 1e-9):.1f} tokens/s) -> {out}", file=sys.stderr)
    return 0
