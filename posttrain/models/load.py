"""Load a causal LM and its tokenizer from a local HF-format directory (or a hub id when online)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from posttrain.models.attention import transformers_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}


# A Hugging Face hub id: ``name`` or ``namespace/name``. Anything else (two slashes, a leading ``.``, ``/`` or ``~``)
# can only be a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def check_model_path(path: str) -> None:
    """One line (``FileNotFoundError``) when ``path`` must be a local model directory and is not one. A name that
    could be a hub id and is no local directory is left to transformers (``model_source`` words its failure)."""
    local = Path(path).expanduser()
    if not local.exists() and _HUB_ID.fullmatch(path):
        return
    if not (local / "config.json").is_file():
        why = "no config.json in it" if local.is_dir() else f"no such directory under {Path.cwd()}"
        raise FileNotFoundError(f"{path}: not an HF model directory ({why}). Build one with `posttrain model tiny "
                                f"{path}` or point model.path at a saved model.")


@contextmanager
def model_source(path: str) -> Iterator[None]:
    """Around a transformers ``from_pretrained(path)``: ``check_model_path`` first, then transformers' ``OSError``
    for a hub id it could not load (no such repo, no network) as one line naming ``path`` — which is also
    what a mistyped relative path of one slash looks like."""
    check_model_path(path)
    try:
        yield
    except OSError as exc:
        if Path(path).expanduser().exists():
            raise
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise FileNotFoundError(f"{path}: no such directory under {Path.cwd()}, and loading it as a Hugging Face hub "
                                f"id failed: {first}") from None


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    with model_source(path):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise ValueError(f"{path}: the tokenizer has no chat template; posttrain formats chats with it")
    return tokenizer


def load_model(
    path: str,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
    quantization_config=None,
) -> PreTrainedModel:
    """``quantization_config`` (a ``BitsAndBytesConfig``, ``posttrain.models.lora``) quantises the weights as
    they load, straight onto ``device``. ``attn_implementation``: ``sdpa``, ``eager`` or ``varlen``
    (``posttrain.models.attention``; resolve ``auto`` first with ``resolve_attn_implementation``)."""
    attn_implementation = transformers_name(attn_implementation)
    with model_source(path):
        if quantization_config is not None:
            return AutoModelForCausalLM.from_pretrained(
                path, dtype=DTYPES[dtype], attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code, quantization_config=quantization_config,
                device_map={"": torch.device(device)},
            )
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=DTYPES[dtype],
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    return model.to(device)
