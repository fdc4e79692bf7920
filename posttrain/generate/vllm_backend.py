"""vLLM backend (GPU): the same request and result types as ``HFBackend``, served by vLLM's paged-attention
engine. Used when ``generate.backend: vllm``; vLLM is an optional extra and is imported only here.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.chat import chat_facts, encode_prompt
from posttrain.data.records import Message
from posttrain.generate.engine import Completion, SamplingParams

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
        # Token prompts, encoded by posttrain's one encoder: vLLM samples from exactly the ids training
        # puts before a completion (letting vLLM tokenize the text can add or drop a BOS).
        inputs = [{"prompt_token_ids": encode_prompt(self.tokenizer, p)} for p in prompts]
        sampling = self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            # The template's end-of-turn token ends a turn even when it is not the tokenizer's EOS (Phi-3, Llama-3).
            stop_token_ids=list(chat_facts(self.tokenizer).end_of_turn_ids) or None,
            seed=params.seed,
        )
        outputs = self.llm.generate(inputs, sampling, use_tqdm=progress)
        results = []
        for output in outputs:
            completions = []
            for choice in output.outputs:
                reason = choice.finish_reason
                if reason == "stop" and not isinstance(choice.stop_reason, str):
                    reason = "eos"  # EOS (no stop reason) or an end-of-turn stop token id, not a stop string
                completions.append(Completion(text=choice.text, token_ids=list(choice.token_ids), finish_reason=reason))
            results.append(completions)
        return results
