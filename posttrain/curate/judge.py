"""Stage 6, judge scoring: a quality score 1-5 with a one-line reason for each record.

Two judges return the same ``Judgement`` (score, reason, and, when they can tell, a complexity
rating 1-3 for the difficulty stage and an intent label for the intent stage):

- ``RuleJudge``: CPU heuristics for smoke runs and laptops (length against what the prompt asks,
  structure, repetition, refusals, answers that look truncated or that restate the prompt).
- ``LLMJudge``: a chat model prompted with a rubric through the generation engine
  (``posttrain.generate``), greedy decoding, output parsed with ``parse_judgement``. A reply with no
  recognisable score gets ``score=None`` and the reason ``judge_unparseable`` — never a crash.

``JudgeStage`` caches judgements keyed by ``sha256(judge fingerprint, prompt, response)`` in a
JSONL file, so a re-run (or the next flywheel round) does not pay for the same record twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from posttrain.curate.config import CurateRecipe, JudgeConfig
from posttrain.curate.filters import top_ngram_char_fraction, words
from posttrain.curate.registry import CURATION_STAGES
from posttrain.curate.rows import Drop, Row
from posttrain.data.io import append_jsonl, iter_raw_records

UNPARSEABLE = "judge_unparseable"


@dataclass
class Judgement:
    score: int | None  # 1..5; None when the judge could not score the record
    reason: str
    complexity: int | None = None  # 1 basic comprehension, 2 logical application, 3 complex creation
    intent: str | None = None


# -- rule-based judge ----------------------------------------------------------------------
_REFUSAL = re.compile(r"\b(i can(?:no|')t|i am unable|i'm unable|i'm sorry,? but|as an ai)\b", re.I)
_ASKS_NUMBER = re.compile(r"\b(how many|how much|what is \d|calculate|compute|sum of|\d+\s*[-+*/x×]\s*\d+)", re.I)
_STRUCTURE = re.compile(r"(^\s*(?:[-*•]|\d+[.)])\s)|```|\n\n", re.M)
_CONSTRAINT = re.compile(
    r"\b(must|exactly|at least|at most|no more than|without|only|do not|don't|format|json|bullet|"
    r"uppercase|lowercase|begin with|end with|in \d+ words|step by step)\b",
    re.I,
)
_MULTISTEP = re.compile(r"\b(then|after that|explain|why|prove|compare|design|plan|analy[sz]e|step)\b", re.I)
_CREATE = re.compile(r"\b(write|compose|create|draft|design|implement|build|story|essay|poem)\b", re.I)
_INTENT_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("coding", re.compile(r"```|\b(code|function|python|javascript|sql|bug|compile|regex|class|api)\b", re.I)),
    ("chit_chat", re.compile(r"^\s*(hi|hello|hey|good (morning|evening)|how are you|thanks|thank you)\b", re.I)),
    ("writing", re.compile(r"\b(write|poem|story|essay|email|letter|draft|compose|slogan)\b", re.I)),
    ("extraction", re.compile(r"\b(extract|list the|find all|summari[sz]e|which of the following)\b", re.I)),
    ("reasoning", re.compile(r"\b(why|explain|prove|calculate|compute|solve|reverse|sort|how many)\b|\d\s*[-+*/]\s*\d", re.I)),
)


class RuleJudge:
    """Heuristic quality score. Deliberately conservative: a short answer to a short task is fine."""

    fingerprint = "rule-judge-v1"

    def __init__(self, labels: Sequence[str] = ()):
        self.labels = set(labels)

    def judge(self, rows: list[Row]) -> list[Judgement]:
        return [self.judge_one(row.prompt, row.response) for row in rows]

    def judge_one(self, prompt: str, response: str) -> Judgement:
        score, notes = 4, []
        response_words, prompt_words = words(response), words(prompt)
        if not response_words:
            return Judgement(1, "empty response", self.complexity(prompt), self.intent(prompt))
        if _REFUSAL.search(response):
            score, notes = score - 2, [*notes, "refuses or hedges"]
        if len(response_words) >= 30 and top_ngram_char_fraction([w.lower() for w in response_words], 3) > 0.1:
            score, notes = score - 1, [*notes, "repetitive"]
        if _ASKS_NUMBER.search(prompt) and not re.search(r"\d", response):
            score, notes = score - 1, [*notes, "asked for a number, gave none"]
        if len(response_words) > 20 and not re.search(r"[.!?:;)\]`\"'*]\s*$", response):
            score, notes = score - 1, [*notes, "looks truncated"]
        overlap = len(set(response_words) & set(prompt_words)) / max(len(set(response_words)), 1)
        if len(response_words) > 8 and overlap > 0.9:
            score, notes = score - 1, [*notes, "mostly restates the prompt"]
        if len(prompt_words) > 25 and len(response_words) < 3 and _CREATE.search(prompt):
            score, notes = score - 1, [*notes, "too short for a creative task"]
        if len(response_words) >= 40 and _STRUCTURE.search(response) and not notes:
            score, notes = score + 1, ["well structured and complete"]
        score = min(max(score, 1), 5)
        reason = "; ".join(notes) if notes else "answers the prompt with no visible problem"
        return Judgement(score, reason, self.complexity(prompt), self.intent(prompt))

    @staticmethod
    def complexity(prompt: str) -> int:
        constraints = len(_CONSTRAINT.findall(prompt))
        if _CREATE.search(prompt) and (constraints >= 2 or len(words(prompt)) > 60):
            return 3
        if constraints >= 2 or _MULTISTEP.search(prompt):
            return 2 if not (constraints >= 3 and _MULTISTEP.search(prompt)) else 3
        return 1

    def intent(self, prompt: str) -> str | None:
        for label, pattern in _INTENT_RULES:
            if pattern.search(prompt):
                return label if not self.labels or label in self.labels else "other"
        fallback = "question_answering"
        return fallback if not self.labels or fallback in self.labels else "other"


# -- LLM judge -------------------------------------------------------------------------------
RUBRIC = """You are grading one training example for an AI assistant.
Rate the RESPONSE to the INSTRUCTION:
5 = correct, complete, clear and well formatted
4 = correct with minor omissions or style problems
3 = partly correct, vague or padded
2 = mostly wrong, off-topic or low effort
1 = wrong, harmful, empty or gibberish
Also rate the instruction's COMPLEXITY: 1 = basic comprehension, 2 = logical application, 3 = complex creation.
And name its INTENT, one of: {labels}.
Reply in exactly this format:
Score: <1-5>
Complexity: <1-3>
Intent: <label>
Reason: <one line>

INSTRUCTION:
{prompt}

RESPONSE:
{response}"""

_SCORE = re.compile(r"(?:score|rating|grade)\s*(?:is|of)?\s*[:=]?\s*\**\s*\(?([1-5])(?:\.0)?\)?(?:\s*/\s*5)?\b", re.I)
_OUT_OF_FIVE = re.compile(r"\b([1-5])(?:\.0)?\s*(?:/|out of)\s*5\b", re.I)
_COMPLEXITY = re.compile(r"complexity\s*[:=]?\s*\**\s*([1-3])\b", re.I)
_INTENT = re.compile(r"intent\s*[:=]\s*\**\s*([A-Za-z_ -]+)", re.I)
_REASON = re.compile(r"reason\s*[:=]\s*(.+)", re.I)


def parse_judgement(text: str, labels: Sequence[str] = ()) -> Judgement:
    """Read ``Score: N`` (also ``Rating: N``, ``N/5``, ``N out of 5``, or a reply that is just a digit)."""
    match = _SCORE.search(text) or _OUT_OF_FIVE.search(text)
    if match is None:
        bare = text.strip().strip("*. ")
        match = re.fullmatch(r"([1-5])", bare)
    if match is None:
        return Judgement(None, f"{UNPARSEABLE}: {' '.join(text.split())[:120]!r}")
    complexity = _COMPLEXITY.search(text)
    reason = _REASON.search(text)
    intent = None
    found = _INTENT.search(text)
    if found:
        label = found.group(1).strip().lower().replace(" ", "_").replace("-", "_")
        intent = label if not labels or label in labels else "other"
    one_line = " ".join(reason.group(1).split())[:200] if reason else "no reason given"
    return Judgement(int(match.group(1)), one_line, int(complexity.group(1)) if complexity else None, intent)


def model_fingerprint(path: str | Path) -> str:
    """A cheap identity of a model directory: config plus size and head/tail bytes of each weight file."""
    path = Path(path)
    digest = hashlib.sha256()
    for file in sorted(path.glob("*")):
        if file.suffix in (".json", ".safetensors", ".bin", ".model", ".txt"):
            digest.update(file.name.encode())
            size = file.stat().st_size
            digest.update(str(size).encode())
            with open(file, "rb") as handle:
                digest.update(handle.read(1 << 20))
                if size > 2 << 20:
                    handle.seek(-(1 << 20), os.SEEK_END)
                    digest.update(handle.read())
    return digest.hexdigest()[:16]


class LLMJudge:
    def __init__(self, config: JudgeConfig, labels: Sequence[str] = ()):
        from posttrain.generate import SamplingParams, get_backend

        self.config, self.labels = config, list(labels)
        backend = config.backend
        if backend == "auto":
            backend = "vllm" if vllm_usable() else "hf"
        self.backend = get_backend(backend, model_path=config.model, dtype=config.dtype)
        self.params = SamplingParams(n=1, temperature=0.0, max_new_tokens=config.max_new_tokens)
        self.fingerprint = f"llm:{model_fingerprint(config.model)}:{hashlib.sha256(RUBRIC.encode()).hexdigest()[:8]}"

    def judge(self, rows: list[Row]) -> list[Judgement]:
        labels = ", ".join(self.labels) or "other"
        prompts = [
            [{"role": "user", "content": RUBRIC.format(labels=labels, prompt=row.prompt, response=row.response)}]
            for row in rows
        ]
        outputs = self.backend.generate(prompts, self.params, batch_size=self.config.batch_size, progress=False)
        return [parse_judgement(samples[0].text, self.labels) for samples in outputs]


def vllm_usable() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


# -- the stage -------------------------------------------------------------------------------
class JudgeCache:
    """Append-only JSONL of judgements; safe for several processes appending whole lines."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self.entries: dict[str, Judgement] = {}
        if self.path and self.path.exists():
            for _, data in iter_raw_records(str(self.path)):
                try:
                    key = data.pop("key")  # type: ignore[union-attr]
                    self.entries[key] = Judgement(**data)  # type: ignore[arg-type]
                except (AttributeError, TypeError, KeyError):
                    continue  # a BadLine (a torn last line from an interrupted run) or an old entry: recompute it

    @staticmethod
    def key(fingerprint: str, prompt: str, response: str) -> str:
        payload = json.dumps([fingerprint, prompt, response], ensure_ascii=False)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def add(self, new: dict[str, Judgement]) -> None:
        self.entries.update(new)
        if self.path and new:
            append_jsonl(str(self.path), [{"key": k, **asdict(v)} for k, v in new.items()])


class JudgeStage:
    name = "judge"

    def __init__(self, config: JudgeConfig, labels: Sequence[str] = (), cache_path: str | Path | None = None):
        self.config = config
        self.judge = LLMJudge(config, labels) if config.kind == "llm" else RuleJudge(labels)
        self.cache = JudgeCache(cache_path if config.cache else None)

    def judgements(self, rows: list[Row]) -> list[Judgement]:
        keys = [JudgeCache.key(self.judge.fingerprint, row.prompt, row.response) for row in rows]
        missing = [i for i, key in enumerate(keys) if key not in self.cache.entries]
        if missing:
            fresh = self.judge.judge([rows[i] for i in missing])
            self.cache.add({keys[i]: judgement for i, judgement in zip(missing, fresh, strict=True)})
        return [self.cache.entries[key] for key in keys]

    def apply(self, rows: list[Row]) -> list[Drop | None]:
        results: list[Drop | None] = []
        for row, judgement in zip(rows, self.judgements(rows), strict=True):
            row.scores.update({"judge": judgement.score, "judge_reason": judgement.reason})
            if judgement.complexity is not None:
                row.scores["judge_complexity"] = judgement.complexity
            if judgement.intent is not None:
                row.scores["judge_intent"] = judgement.intent
            if judgement.score is None:
                drop = self.config.on_unparseable == "drop"
                results.append(Drop(UNPARSEABLE, judgement.reason) if drop else None)
            elif self.config.min_score is not None and judgement.score < self.config.min_score:
                results.append(Drop("judge_low_score", f"{judgement.score}: {judgement.reason}"))
            else:
                results.append(None)
        return results


@CURATION_STAGES.register("judge")
def _judge_stage(recipe: CurateRecipe, cache_dir: str | None) -> JudgeStage:
    cache = Path(cache_dir, "judge.jsonl") if cache_dir else None
    return JudgeStage(recipe.judge, list(recipe.intent.labels), cache)
