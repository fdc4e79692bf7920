"""Load a causal LM and its tokenizer from a local HF-format directory (or a hub id when online)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from posttrain.models.attention import transformers_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}


def _check_path(path: str) -> None:
    local = Path(path)
    looks_local = path.startswith((".", "/", "~")) or local.exists()
    if looks_local and not (local / "config.json").exists():
        raise FileNotFoundError(
            f"{path}: not an HF model directory (no config.json). Build one with `posttrain model tiny {path}`"
            " or point model.path at a saved model."
        )


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    _check_path(path)
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
    _check_path(path)
    attn_implementation = transformers_name(attn_implementation)
    if quantization_config is not None:
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
            quantization_config=quantization_config, device_map={"": torch.device(device)},
        )
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=DTYPES[dtype],
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    return model.to(device)
