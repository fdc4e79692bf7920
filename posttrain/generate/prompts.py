"""How a prompt file's string prompts reach the model, decided in one place for ``posttrain generate`` and
``posttrain eval`` (``--prompt-format auto|chat|raw``), so the same file is the same text on both.

- ``chat``: a string prompt becomes one user turn, rendered with the model's chat template (assistant turn
  opened), as training formats a chat;
- ``raw``: a string prompt is sent as written, no template;
- ``auto`` (default): ``chat`` when the tokenizer has a chat template, else ``raw``.

A prompt that is already a chat (a list of messages) always goes through the template: it has no text "as
written". The backend renders and encodes (``posttrain.data.chat.render_prompt``); this module only decides
whether a string is wrapped as a user turn first.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from posttrain.data.records import Message

PROMPT_FORMATS = ("auto", "chat", "raw")


class PromptFormatError(ValueError):
    """The format asked for cannot be used with this model; the message names the flag to change."""


def add_prompt_format_argument(parser: argparse.ArgumentParser, legacy_flag: str, legacy_value: str) -> None:
    """``--prompt-format``, the same flag on both commands; ``legacy_flag`` (the command's old spelling) is kept,
    hidden, meaning ``--prompt-format legacy_value``, so existing scripts keep working."""
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="auto",
                        help="how string prompts reach the model: chat = one user turn through the model's chat "
                        "template; raw = the text as written; auto (default) = chat when the tokenizer has a chat "
                        "template, else raw. Chats (message lists) always use the template. The first line on "
                        "stderr says which was used")
    parser.add_argument(legacy_flag, dest="prompt_format", action="store_const", const=legacy_value,
                        help=argparse.SUPPRESS)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_prompt_format(requested: str, tokenizer: Any) -> str:
    """``chat`` or ``raw`` for ``requested`` (one of ``PROMPT_FORMATS``) and the model's ``tokenizer``.

    ``tokenizer`` None means a backend that renders chats itself: ``auto`` is then ``chat``."""
    if requested not in PROMPT_FORMATS:
        raise PromptFormatError(f"prompt format {requested!r}: one of {', '.join(PROMPT_FORMATS)}")
    templated = tokenizer is None or has_chat_template(tokenizer)
    if requested == "auto":
        return "chat" if templated else "raw"
    if requested == "chat" and not templated:
        raise PromptFormatError("--prompt-format chat: the model's tokenizer has no chat template; use --prompt-format raw "
                         "(or auto) to send string prompts as written")
    return requested


def apply_prompt_format(prompts: Sequence[str | list[Message]], prompt_format: str) -> list[str | list[Message]]:
    """The prompts as the backend takes them: under ``chat`` a string becomes ``[user: string]``; chats and,
    under ``raw``, strings are passed unchanged."""
    if prompt_format not in ("chat", "raw"):
        raise ValueError(f"apply_prompt_format: resolve {prompt_format!r} first (resolve_prompt_format)")
    if prompt_format == "raw":
        return list(prompts)
    return [[Message(role="user", content=p)] if isinstance(p, str) else list(p) for p in prompts]


def describe_prompt_format(prompt_format: str, requested: str) -> str:
    """The line both commands print first: which format, and why."""
    if prompt_format == "chat":
        why = "auto: the model has a chat template" if requested == "auto" else "--prompt-format chat"
        return (f"prompt format: chat ({why}); string prompts are sent as a user turn through the chat template "
                "(--prompt-format raw sends them as written)")
    why = "auto: the model has no chat template" if requested == "auto" else "--prompt-format raw"
    return f"prompt format: raw ({why}); string prompts are sent as written, chats still get the chat template"


def prompt_format_of_model(model_path: str, requested: str) -> str:
    """``resolve_prompt_format`` against the tokenizer in ``model_path``, loaded on its own so that the choice is
    known (and printed) before the weights load. Any backend reads the same tokenizer files."""
    if requested == "raw":
        return "raw"  # nothing to look up
    from transformers import AutoTokenizer

    from posttrain.models.load import model_source

    with model_source(model_path):
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    return resolve_prompt_format(requested, tokenizer)
