"""The sampler shared by evaluation, rejection sampling and RL: one request type, one result type,
interchangeable backends.

``HFBackend`` runs anywhere transformers runs: a batched decode loop with a KV cache over left-padded
prompts. ``ServedVLLM`` (``posttrain.generate.vllm_served``) samples with a vLLM server in its own process.

Determinism: every sequence draws its randomness from its own generator seeded by
``(params.seed, prompt key, sample index)`` (the prompt key is its index in the request unless
``seed_keys`` gives one), so results repeat run to run and do not depend on ``batch_size`` or on how
prompts are split over calls or ranks (greedy decoding is bit-identical across batch sizes in float32;
sampled decoding is identical up to float noise at a bin edge). A sequence draws its
``max_new_tokens`` uniforms in one call when its batch starts (the same stream as one draw per step).

Log-probs at sampling time (``SamplingParams.logprobs``): for each generated token,
``log softmax(logits / T)[token]`` in float32, computed from the same logits the token was drawn from.
Temperature is applied; top-p / top-k are *not*: the number is the log-prob under the tempered model
distribution, which is what a training forward that divides its logits by the same ``T`` computes
(``posttrain.models.logprobs``, ``temperature=``), so RL ratios start at exactly 1 up to float noise.
With top-p / top-k on, the tokens come from the truncated distribution while the log-probs are of the
untruncated one (say so where that matters). Greedy decoding (``T = 0``) records ``T = 1`` log-probs,
the model's own distribution.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

# Prompts are rendered and encoded by posttrain.data.chat, the same code training uses, so the ids a
# completion is sampled from are the ids training computes its log-probs after.
from posttrain.data.chat import Prompt, chat_facts, encode_prompt, render_prompt
from posttrain.data.records import Message
from posttrain.generate.sampling import (
    apply_temperature,
    filter_top_k,
    filter_top_p,
    greedy,
    row_seed,
    sample_inverse_cdf,
    token_logprobs,
)
from posttrain.models.routing_replay import RoutingRecorder, recording
from posttrain.progress import progress as progress_bar
from posttrain.threads import one_thread_for_small_steps

__all__ = [
    "BACKENDS",
    "Backend",
    "Completion",
    "HFBackend",
    "Prompt",
    "SamplingParams",
    "encode_prompt",
    "get_backend",
    "render_prompt",
]

FINISH_REASONS = ("stop", "length", "eos")


class SamplingError(ValueError):
    """Sampling settings out of range (``--top-p 2``, ``--n 0``…), or a prompt with nothing to sample from: bad input,
    one line that names the setting and its range."""


@dataclass
class SamplingParams:
    """What to sample. ``temperature == 0`` means greedy (then ``top_p``/``top_k`` are ignored).

    ``logprobs``: also record each generated token's log-prob (``Completion.logprobs``; see the module
    docstring for exactly which distribution). ``routed_experts``: also record the experts every MoE router
    chose for every token (``Completion.routed_experts``; ``HFBackend`` only, for rollout routing replay,
    ``posttrain.models.routing_replay``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    logprobs: bool = False
    routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise SamplingError(f"n must be >= 1 (got {self.n})")
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0 (got {self.temperature}); 0 means greedy")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (got {self.top_k}); 0 disables it")
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    """One sampled continuation.

    ``token_ids`` are exactly the sampled tokens (including the EOS token, or the token that completed a
    stop string); ``text`` is their decoding without special tokens, cut before the first stop string.
    ``finish_reason``: "eos" (the model ended its turn), "stop" (a stop string appeared) or "length"
    (``max_new_tokens`` reached). ``logprobs``: one float32 log-prob per entry of ``token_ids`` when
    ``SamplingParams.logprobs`` was on, else ``None``. ``routed_experts``: with ``SamplingParams.routed_experts``,
    the int16 array ``[prompt + completion tokens, MoE layers, K]`` of ``posttrain.models.routing_replay``.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None
    routed_experts: Any = None


@runtime_checkable
class Backend(Protocol):
    def generate(
        self,
        prompts: list[list[Message]] | list[str],
        params: SamplingParams,
        batch_size: int = 8,
        progress: bool = True,
        seed_keys: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """Return ``params.n`` completions for each prompt, in prompt order.

        ``seed_keys[i]`` replaces prompt ``i``'s position in the request in its sequences' seeds: give
        global prompt indices when a request is one rank's (or one call's) share of a larger one.
        """
        ...


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Cut ``text`` before the earliest stop string; return (text, whether one was found)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class HFBackend:
    """Batched sampling from a transformers causal LM with a KV cache.

    ``model`` may be the live policy of a training loop (its train/eval mode is restored afterwards).
    Prompts are left-padded; position ids count real tokens only, so a padded row computes what it would
    compute alone. The ``n`` samples of a prompt share one prefill (its KV cache rows are copied), which
    matters for RL groups (``n = G``) with long prompts.
    """

    def __init__(self, model: Any, tokenizer: Any, device: str | torch.device | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = _eos_ids(model, tokenizer)
        forward_params = inspect.signature(model.forward).parameters
        # transformers >= 5.x names the cache argument `cache`; earlier versions `past_key_values`.
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._supports_logits_to_keep = "logits_to_keep" in forward_params
        self.parameter_count = sum(p.numel() for p in model.parameters())

    @classmethod
    def from_path(cls, path: str | Path, dtype: str = "float32", device: str | None = None) -> HFBackend:
        from posttrain.models.load import load_model, load_tokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(load_model(str(path), dtype=dtype, device=device), load_tokenizer(str(path)), device=device)

    def generate(
        self,
        prompts: list[list[Message]] | list[str],
        params: SamplingParams,
        batch_size: int = 8,
        progress: bool = True,
        seed_keys: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        if batch_size < 1:
            raise SamplingError(f"batch_size must be >= 1 (got {batch_size})")
        keys = _seed_keys(seed_keys, len(prompts))
        encoded = [encode_prompt(self.tokenizer, p) for p in prompts]
        for index, ids in enumerate(encoded):
            if not ids:
                raise SamplingError(f"prompt {index} is empty after tokenization")
        # One row per (prompt, sample); longest first so each batch holds similar lengths (less padding).
        rows = [(p, s) for p in range(len(prompts)) for s in range(params.n)]
        rows.sort(key=lambda row: -len(encoded[row[0]]))
        results: list[list[Completion | None]] = [[None] * params.n for _ in prompts]
        was_training = getattr(self.model, "training", False)
        self.model.eval()
        try:
            bar = progress_bar(total=len(rows), desc="generate", unit="seq", disable=not progress)
            with torch.no_grad(), bar, recording(self.model, params.routed_experts) as recorder:
                for start in range(0, len(rows), batch_size):
                    chunk = rows[start : start + batch_size]
                    seeds = [row_seed(params.seed, keys[p], s) for p, s in chunk]
                    completions = self._generate_batch([encoded[p] for p, _ in chunk], seeds, params, recorder)
                    for (p, s), completion in zip(chunk, completions, strict=True):
                        results[p][s] = completion
                    bar.update(len(chunk))
        finally:
            if was_training:
                self.model.train()
        return results  # type: ignore[return-value]

    def generate_ids(self, prompt_ids: list[list[int]], seeds: list[int], params: SamplingParams,
                     batch_size: int = 8) -> list[Completion]:
        """One completion per row of ``prompt_ids`` (token ids, not rendered text), row ``i`` drawing its randomness
        from the generator seeded ``seeds[i]`` (``params.n`` is ignored). For contexts that already hold sampled
        tokens (multi-turn rollouts, ``posttrain.rl.multiturn``): re-rendering their text could tokenize it
        differently."""
        if batch_size < 1:
            raise SamplingError(f"batch_size must be >= 1 (got {batch_size})")
        if len(seeds) != len(prompt_ids) or any(not ids for ids in prompt_ids):
            raise SamplingError("generate_ids needs one seed per row and non-empty rows")
        was_training = getattr(self.model, "training", False)
        self.model.eval()
        out: list[Completion] = []
        try:
            with torch.no_grad():
                for start in range(0, len(prompt_ids), batch_size):
                    out += self._generate_batch(prompt_ids[start : start + batch_size],
                                                seeds[start : start + batch_size], params)
        finally:
            if was_training:
                self.model.train()
        return out

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        kwargs = {self._cache_kwarg: cache, "use_cache": True}
        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        return out.logits[:, -1, :].float()

    def _choose(
        self, logits: torch.Tensor, uniforms: torch.Tensor | None, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next token per row, and its log-prob under ``softmax(logits / T)`` when asked (T = 1 if greedy)."""
        if params.greedy:
            tokens, scaled = greedy(logits), logits
        else:
            scaled = apply_temperature(logits, params.temperature)
            tokens = sample_inverse_cdf(filter_top_p(filter_top_k(scaled, params.top_k), params.top_p), uniforms)
        return tokens, token_logprobs(scaled, tokens) if params.logprobs else None

    def _generate_batch(self, prompt_ids: list[list[int]], seeds: list[int], params: SamplingParams,
                        recorder: RoutingRecorder | None = None) -> list[Completion]:
        from transformers import DynamicCache

        # Rows that share a prompt (the n samples of one prompt sit side by side) share its prefill: each
        # distinct prompt is run once and its cache rows and last logits are copied to its samples.
        distinct: dict[tuple[int, ...], int] = {}
        source = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompt_ids]
        unique_ids = [list(ids) for ids in distinct]
        width = max(len(ids) for ids in unique_ids)
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in unique_ids], device=self.device)
        attention = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids in unique_ids], device=self.device, dtype=torch.long
        )
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        # Each row's uniforms for every step, drawn once from its own generator: [rows, max_new_tokens].
        uniforms = None if params.greedy else torch.stack([
            torch.rand(params.max_new_tokens, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            for seed in seeds
        ])
        cache = DynamicCache(config=getattr(self.model, "config", None))
        logits = self._forward(input_ids, attention, positions, cache)
        if recorder is not None:
            recorder.prefill(attention, source)
        if len(unique_ids) < len(prompt_ids):
            to_rows = torch.tensor(source, device=self.device)
            cache.batch_select_indices(to_rows)
            logits, attention, positions = logits[to_rows], attention[to_rows], positions[to_rows]
        next_position = positions[:, -1] + 1

        generated: list[list[int]] = [[] for _ in prompt_ids]
        logprobs: list[list[float]] = [[] for _ in prompt_ids]
        finish: list[str | None] = [None] * len(prompt_ids)
        active = list(range(len(prompt_ids)))  # batch rows (original indices) still decoding
        # Decode steps of a small model are too little work to share out over sleeping threads.
        with one_thread_for_small_steps(2 * self.parameter_count * len(active)):
            for step in range(params.max_new_tokens):
                tokens, token_lps = self._choose(logits, None if uniforms is None else uniforms[:, step], params)
                if token_lps is not None:
                    for value, row in zip(token_lps.tolist(), active, strict=True):
                        logprobs[row].append(value)
                for token, row in zip(tokens.tolist(), active, strict=True):
                    generated[row].append(token)
                    if token in self.eos_ids:
                        finish[row] = "eos"
                    elif params.stop and cut_at_stop(self._decode(generated[row]), params.stop)[1]:
                        finish[row] = "stop"
                    elif step == params.max_new_tokens - 1:
                        finish[row] = "length"
                keep = [j for j, row in enumerate(active) if finish[row] is None]
                if not keep:
                    break
                if len(keep) < len(active):
                    index = torch.tensor(keep, device=self.device)
                    cache.batch_select_indices(index)
                    attention, tokens, next_position = attention[index], tokens[index], next_position[index]
                    if uniforms is not None:
                        uniforms = uniforms[index.cpu()]
                    active = [active[j] for j in keep]
                attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=1)
                logits = self._forward(tokens[:, None], attention, next_position[:, None], cache)
                if recorder is not None:
                    recorder.decode(active)
                next_position = next_position + 1

        completions = []
        for row, token_ids in enumerate(generated):
            text = self._decode([t for t in token_ids if t not in self.eos_ids])
            text, _ = cut_at_stop(text, params.stop)
            completions.append(Completion(text=text, token_ids=token_ids, finish_reason=finish[row] or "length",
                                          logprobs=logprobs[row] if params.logprobs else None,
                                          routed_experts=None if recorder is None
                                          else recorder.result(row, len(token_ids))))
        return completions

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _seed_keys(seed_keys: Sequence[int] | None, count: int) -> list[int]:
    if seed_keys is None:
        return list(range(count))
    keys = [int(k) for k in seed_keys]
    if len(keys) != count:
        raise ValueError(f"seed_keys has {len(keys)} entries for {count} prompts; give one per prompt")
    if len(set(keys)) != count:
        raise ValueError("seed_keys must be distinct: two prompts with one key would draw the same samples")
    return keys


def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Tokens that end a sequence: the tokenizer's EOS, the model's configured EOS ids, and the chat
    template's end-of-turn token (Phi-3's ``<|end|>``, Llama-3's ``<|eot_id|>``) when it is one token."""
    ids: set[int] = set(chat_facts(tokenizer).end_of_turn_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, list | tuple):
        ids.update(int(i) for i in configured)
    return ids


BACKENDS = ("hf", "vllm")


def close_backend(backend: Any) -> None:
    """Stop what a backend started (the vllm backend's engine process); the hf backend holds nothing."""
    close = getattr(backend, "close", None)
    if close is not None:
        close()


def get_backend(
    name: str,
    model: Any = None,
    tokenizer: Any = None,
    *,
    model_path: str | Path | None = None,
    dtype: str = "float32",
    device: str | None = None,
    **options: Any,
) -> Backend:
    """Build a backend by name.

    ``hf``: pass an in-memory ``model`` and ``tokenizer``, or a model directory (``model_path``, or a path
    as ``model``). ``vllm``: a vLLM server in its own process for a model directory
    (``posttrain.generate.vllm_served``; ``EngineSetupError`` saying how to install the engine when no Python
    with vLLM is found). Extra ``options`` go to ``ServedVLLM`` (``url``, ``python``, ``engine_args``…).
    """
    if isinstance(model, str | Path):
        model_path, model = model, None
    if name == "hf":
        if options:
            raise ValueError(f"the hf backend takes no extra options (got {sorted(options)})")
        if model is not None:
            if tokenizer is None:
                raise ValueError("get_backend('hf', model, tokenizer): an in-memory model needs its tokenizer")
            return HFBackend(model, tokenizer, device=device)
        if model_path is None:
            raise ValueError("get_backend('hf'): give a model and tokenizer, or model_path")
        return HFBackend.from_path(model_path, dtype=dtype, device=device)
    if name == "vllm":
        from posttrain.generate.vllm_served import ServedVLLM

        if model_path is None:
            raise ValueError(
                "the vllm backend loads weights itself: give a model directory (model_path), not an in-memory model"
            )
        return ServedVLLM(str(model_path), dtype=dtype, **options)
    raise ValueError(f"unknown generation backend {name!r}; choose one of: {', '.join(BACKENDS)}")
