"""vLLM backend (GPU): the same request and result types as ``HFBackend``, served by vLLM's paged-attention
engine. Used when ``generate.backend: vllm``; vLLM is an optional extra and is imported only here.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.records import Message
from posttrain.generate.engine import Completion, SamplingParams, render_prompt

INSTALL_HINT = (
    "the vllm generation backend needs vLLM, which is not installed. Install it on a CUDA machine with "
    "`pip install 'posttrain[vllm]'`, or use the backend that works everywhere: generate.backend: hf "
    "(CLI: --backend hf)."
)


class VLLMUnavailable(ImportError):
    """vLLM is not installed; the message says how to install it or which backend to use instead."""


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnavailable(INSTALL_HINT) from exc
    return vllm


class VLLMBackend:
    """Sampling through ``vllm.LLM``. vLLM draws with its own RNG, so samples repeat for a given seed but
    differ from ``HFBackend``'s; greedy outputs match up to kernel numerics."""

    def __init__(self, model_path: str, dtype: str = "float32", **engine_options: Any):
        vllm = _import_vllm()
        self._vllm = vllm
        dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
        self.llm = vllm.LLM(model=model_path, dtype=dtype, **engine_options)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(
        self,
        prompts: list[list[Message]] | list[str],
        params: SamplingParams,
        batch_size: int = 8,
        progress: bool = True,
    ) -> list[list[Completion]]:
        # vLLM schedules its own batches (continuous batching); batch_size does not apply.
        del batch_size
        texts = [render_prompt(self.tokenizer, p) for p in prompts]
        sampling = self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            seed=params.seed,
        )
        outputs = self.llm.generate(texts, sampling, use_tqdm=progress)
        results = []
        for output in outputs:
            completions = []
            for choice in output.outputs:
                reason = choice.finish_reason
                if reason == "stop" and choice.stop_reason is None:
                    reason = "eos"  # vLLM reports EOS as "stop" with no stop string
                completions.append(Completion(text=choice.text, token_ids=list(choice.token_ids), finish_reason=reason))
            results.append(completions)
        return results
