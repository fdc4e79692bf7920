"""Load a causal LM and its tokenizer from a local HF-format directory, or a hub id (online, or from the cache).

Which paths can load is ``posttrain.models.source``'s business (``check_model_path``), kept free of torch and
transformers so that the CLI asks it before the training stack is imported."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from posttrain.data.chat import TemplateError
from posttrain.models.attention import transformers_name
from posttrain.models.source import check_model_path, hub_failure

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}


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
        raise hub_failure(path, first) from None


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    with model_source(path):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise TemplateError(f"{path}: the tokenizer has no chat template; posttrain formats chats with it. Use an "
                            "instruct/chat model, or add one (a `chat_template.jinja` file next to tokenizer_config.json, "
                            "or its `chat_template` key, e.g. copied from the instruct variant of this model)")
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
    from posttrain.progress import quiet_hf_progress

    quiet_hf_progress()  # no carriage-return "Loading weights" bar in a log
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
