"""``posttrain sample``: rejection sampling (best-of-n) for the next round's SFT and preference data.

Prompts are read through ``posttrain.data`` from any record source (JSONL, JSON, Parquet, saved
datasets, ``.gz``) and any record format (``formats.to_prompt``); a line that gives no prompt is
dropped at ``parse`` with the funnel reason of ``posttrain.curate.rows``. For each prompt the policy
draws ``n`` candidates; a scorer rates them (``scorer.kind: auto`` picks the prompt's verifier when
it has an answer key, else the reward model when one is configured, else the judge). The best candidate becomes an SFT target when it reaches ``min_score``; when the
best and worst differ by more than ``pair_margin``, they become a preference pair (chosen = best,
rejected = worst) with both scores and a rationale naming the scorer. Ties go to the earliest
candidate for "best" and the latest for "worst", so the choice is deterministic.

Outputs in ``output_dir``: ``sft.jsonl``, ``preferences.jsonl``, ``candidates.jsonl`` (every
candidate with its score, for audit), ``dropped.jsonl``, ``funnel.json``, ``manifest.json``.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from posttrain.curate.config import SampleRecipe
from posttrain.curate.funnel import Funnel, format_funnel, write_manifest
from posttrain.curate.rows import Drop, drop_for
from posttrain.curate.scorers import JudgeScorer, PromptRecord, RewardModelScorer, Scorer, VerifierScorer
from posttrain.data.formats import FormatError, to_prompt
from posttrain.data.io import BadLine, iter_raw_records, jsonl_writer
from posttrain.data.records import stable_id
from posttrain.progress import progress
from posttrain.rl.reward_config import RewardSetupError

CHUNK_PROMPTS = 256  # prompts generated and scored per step; bounds memory for big prompt files


def parse_prompt(item: dict[str, Any] | BadLine, line: int) -> PromptRecord | Drop:
    """One decoded input line → a prompt with its answer key, or a named ``Drop``.

    Any record the data layer reads gives its prompt (``posttrain.data.formats.to_prompt``: an RL
    prompt as it is, a chat without its last assistant reply, a pair's prompt). The answer key is the
    RL record's own ``answer`` / ``verifier`` / ``tests``, else the same names in ``meta`` (where the
    data layer also puts top-level keys a format does not know).
    """
    if isinstance(item, BadLine):
        return drop_for(item)
    try:
        record, _ = to_prompt(item)
    except FormatError as exc:
        return drop_for(exc)
    meta = record.meta

    def key(name: str) -> Any:
        value = getattr(record, name, None)
        return value if value is not None else meta.get(name)

    options = meta.get("options") or meta.get("verifier_options") or {}
    answer = key("answer")
    tier = record.tier if record.tier is not None else meta.get("tier")
    return PromptRecord(
        id=record.id,
        messages=[m.model_dump() for m in record.prompt],
        verifier=key("verifier"),
        answer=None if answer is None else str(answer),
        tests=key("tests"),
        options=options if isinstance(options, dict) else {},
        tier=tier if isinstance(tier, int) and 1 <= tier <= 3 else None,
        meta=meta,
        line=line,
    )


def best_and_worst(scores: list[float | None]) -> tuple[int, int] | None:
    """Indices of the best (earliest on ties) and worst (latest on ties) scored candidates."""
    scored = [(s, i) for i, s in enumerate(scores) if s is not None]
    if not scored:
        return None
    best = min(scored, key=lambda item: (-item[0], item[1]))[1]
    worst = max(scored, key=lambda item: (-item[0], item[1]))[1]
    return best, worst


class Sampler:
    """Draws candidates from the policy and scores them; ``backend`` may be given (any object with the
    ``posttrain.generate.Backend`` interface), else it is built from ``config.policy``."""

    def __init__(self, config: SampleRecipe, backend: Any = None):
        from posttrain.generate import SamplingParams, get_backend

        self.config = config
        kind = config.policy.backend
        if kind == "auto":
            from posttrain.curate.judge import vllm_usable

            kind = "vllm" if vllm_usable() else "hf"
        self.owns_backend = backend is None
        self.backend = backend or get_backend(kind, model_path=config.policy.path, dtype=config.policy.dtype)
        s = config.sampling
        self.params = SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                     max_new_tokens=s.max_new_tokens, seed=s.seed)  # fmt: skip
        self._scorers: dict[str, Scorer] = {}

    def scorer_for(self, prompt: PromptRecord) -> str:
        kind = self.config.scorer.kind
        if kind != "auto":
            return kind
        if prompt.verifiable:
            return "verifier"
        return "reward_model" if self.config.scorer.reward_model is not None else "judge"

    def scorer(self, kind: str) -> Scorer:
        if kind not in self._scorers:
            if kind == "verifier":
                self._scorers[kind] = VerifierScorer()
            elif kind == "reward_model":
                self._scorers[kind] = RewardModelScorer(self.config.scorer.reward_model)  # type: ignore[arg-type]
            else:
                self._scorers[kind] = JudgeScorer(self.config.scorer.judge)
        return self._scorers[kind]

    def score(self, prompts: list[PromptRecord], candidates: list[list[str]]) -> tuple[list[str], list[list]]:
        kinds = [self.scorer_for(p) for p in prompts]
        scores: list[list[float | None]] = [[] for _ in prompts]
        for kind in sorted(set(kinds)):
            chosen = [i for i, k in enumerate(kinds) if k == kind]
            if kind == "verifier":
                check_verifiable([prompts[i] for i in chosen])
            found = self.scorer(kind).score([prompts[i] for i in chosen], [candidates[i] for i in chosen])
            for i, values in zip(chosen, found, strict=True):
                scores[i] = values
        return kinds, scores

    def close(self) -> None:
        """Stop what the backend built here started (a vllm policy's engine); a given backend is the caller's."""
        if self.owns_backend:
            from posttrain.generate.engine import close_backend

            close_backend(self.backend)

    def generate(self, prompts: list[PromptRecord]) -> list[list[str]]:
        outputs = self.backend.generate([p.messages for p in prompts], self.params,
                                        batch_size=self.config.sampling.batch_size, progress=False)  # fmt: skip
        return [[c.text for c in samples] for samples in outputs]


def check_verifiable(prompts: list[PromptRecord]) -> None:
    """``scorer.kind=verifier`` needs a verifier and an answer key on every prompt: refused before any sampling."""
    loose = [prompt for prompt in prompts if not prompt.verifiable]
    if loose:
        raise RewardSetupError(
            f"scorer.kind=verifier, but {len(loose)} of {len(prompts)} prompts have no verifier and answer key "
            f"(first: {loose[0].id}, line {loose[0].line}); set scorer.kind=auto (a verifier where a prompt has its "
            "key, else scorer.reward_model or the judge), or give every prompt `verifier` and `answer`")


def _read_prompts(paths: list[str], funnel: Funnel, dropped) -> list[PromptRecord]:
    prompts: list[PromptRecord] = []
    reasons: Counter = Counter()
    total = 0
    for path in paths:
        if not Path(path).exists():
            raise FileNotFoundError(f"{path}: prompt file not found (data.input)")
        for number, item in iter_raw_records(path):
            total += 1
            parsed = parse_prompt(item, number)
            if isinstance(parsed, Drop):
                reasons[parsed.reason] += 1
                dropped.write({"source": path, "line": number, "stage": "parse", "reason": parsed.reason,
                               "detail": parsed.detail, "record": item.raw if isinstance(item, BadLine) else item})
            else:
                prompts.append(parsed)
    funnel.input = total
    funnel.add("parse", total, len(prompts), reasons)
    return prompts


def rejection_sample(config: SampleRecipe, sampler: Sampler | None = None) -> dict:
    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    funnel = Funnel(["parse", "select"])
    pairs = Counter()
    scorer_use: Counter = Counter()
    paths = {name: output / f"{name}.jsonl" for name in ("sft", "preferences", "candidates", "dropped")}
    with ExitStack() as stack:
        handles = {name: stack.enter_context(jsonl_writer(str(path))) for name, path in paths.items()}
        prompts = _read_prompts(config.data.paths(), funnel, handles["dropped"])
        if config.scorer.kind == "verifier":
            check_verifiable(prompts)  # before the policy loads and samples
        if sampler is None:
            sampler = Sampler(config)
            stack.callback(sampler.close)  # a vllm policy's engine process stops with the command
        bar = progress(total=len(prompts), desc="sample", unit="prompt", disable=not config.progress)
        for start in range(0, len(prompts), CHUNK_PROMPTS):
            chunk = prompts[start : start + CHUNK_PROMPTS]
            candidates = sampler.generate(chunk)
            kinds, scores = sampler.score(chunk, candidates)
            for prompt, texts, kind, values in zip(chunk, candidates, kinds, scores, strict=True):
                scorer_use[kind] += 1
                verdict = _select(prompt, texts, kind, values, config, handles, pairs)
                funnel.add("select", 1, 0 if verdict else 1, {verdict.reason: 1} if verdict else {})
                if verdict:
                    handles["dropped"].write({"id": prompt.id, "source": "sample", "line": prompt.line,
                                              "stage": "select", "reason": verdict.reason, "detail": verdict.detail,
                                              "scores": values, "record": {"messages": prompt.messages,
                                                                           "candidates": texts}})  # fmt: skip
            bar.update(len(chunk))
        bar.close()
    kept = funnel.stages["select"].kept
    n = config.sampling.n
    funnel.extra = {
        "candidates": {"drawn": funnel.stages["select"].seen * n, "kept_as_sft": kept,
                       "rejected": funnel.stages["select"].seen * n - kept},
        "pairs": {"emitted": pairs["emitted"], **{k: v for k, v in pairs.items() if k != "emitted"}},
        "scorers": dict(scorer_use),
    }  # fmt: skip
    funnel.check(kept)
    summary = funnel.to_dict(kept)
    (output / "funnel.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    outputs = {"sft": paths["sft"], "preferences": paths["preferences"], "dropped": paths["dropped"]}
    return write_manifest(output, "sample", outputs, config.data.paths(), config, summary,
                          exclude={"output_dir", "progress", "data"})  # fmt: skip


def _select(prompt: PromptRecord, texts: list[str], kind: str, scores: list, config: SampleRecipe,
            handles: dict, pairs: Counter) -> Drop | None:  # fmt: skip
    """Write the candidates, the SFT target and the preference pair of one prompt; return a Drop if none."""
    handles["candidates"].write({"id": prompt.id, "scorer": kind, "candidates": texts, "scores": scores})
    usable = [s if text.strip() else None for s, text in zip(scores, texts, strict=True)]
    if not any(text.strip() for text in texts):
        return Drop("empty_generations", f"all {len(texts)} candidates are empty")
    chosen = best_and_worst(usable)
    if chosen is None:
        return Drop("unscorable", f"the {kind} scorer could not score any candidate")
    best, worst = chosen
    best_score, worst_score = usable[best], usable[worst]
    margin = best_score - worst_score
    if margin > config.pair_margin and texts[best].strip() != texts[worst].strip():
        pair = {
            "id": stable_id([prompt.id, texts[best], texts[worst]], "pref-"),
            "kind": "preference",
            "prompt": prompt.messages,
            "chosen": [{"role": "assistant", "content": texts[best]}],
            "rejected": [{"role": "assistant", "content": texts[worst]}],
            "rationale": f"rejection sampling: {kind} scored {best_score:g} vs {worst_score:g} of {len(texts)} samples",
            "chosen_score": best_score,
            "rejected_score": worst_score,
            "tier": prompt.tier,
            "meta": {"source_prompt": prompt.id, "scorer": kind},
        }
        handles["preferences"].write(pair)
        pairs["emitted"] += 1
    else:
        pairs["identical_best_and_worst" if margin > config.pair_margin else "margin_not_above_threshold"] += 1
    if config.min_score is not None and best_score < config.min_score:
        return Drop("below_min_score", f"best {kind} score {best_score:g} < {config.min_score:g}")
    example = {
        "id": stable_id([prompt.id, texts[best]], "sft-"),
        "kind": "sft",
        "messages": [*prompt.messages, {"role": "assistant", "content": texts[best]}],
        "tier": prompt.tier,
        "meta": {**prompt.meta, "sample": {"source_prompt": prompt.id, "scorer": kind, "score": best_score,
                                           "scores": scores, "best_index": best}},  # fmt: skip
    }
    handles["sft"].write(example)
    return None


def run_sample(config: SampleRecipe) -> int:
    manifest = rejection_sample(config)
    print(format_funnel(manifest["funnel"]))
    out = Path(config.output_dir)
    print(f"SFT targets → {out / 'sft.jsonl'}; preference pairs → {out / 'preferences.jsonl'}")
    return 0
