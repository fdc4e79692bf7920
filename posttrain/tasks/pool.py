"""A raw instruction pool with planted noise, so the curation funnel has real work to do.

``raw_pool(n, seed)`` returns ``{"id", "prompt", "response", "tier", "meta"}`` records built from the
train split. Each prompt is a short instruction preamble (one of a few variants), a sentence
naming the problem's numbers or words, then the task: long enough for 5-word shingles to mean
something, and distinct problems stay below Jaccard 0.7 of each other (checked as the pool is
built). ``NoiseMix`` says which share of the pool is planted with each kind of noise; every
planted record names its kind in ``meta["planted"]`` (clean records have ``None``):

- ``exact_duplicate``: a byte-for-byte copy of a clean record (``meta["duplicate_of"]`` = its id,
  which comes earlier in the pool).
- ``near_duplicate``: a copy of a clean record with its first word swapped for a synonym or a
  filler word put in front; 5-word-shingle Jaccard >= 0.8 with the original.
- ``garbled``: the task text hit by mojibake (``Ã©``, ``â€“``) or U+FFFD replacement characters.
- ``empty``: an empty or whitespace-only response.
- ``truncated``: the reference answer cut short (whole lines, else whole words, else characters).
- ``wrong_answer``: a plausible wrong answer that fails the task's verifier.
- ``off_topic``: a fluent, well-formed answer to a *different* problem (0 by default).

``unkeyed_share`` > 0 withholds the answer key from that share of the records (any kind), as most
user data comes without one: a verifier stage cannot check them, so a fluent wrong or off-topic
answer among them passes every rule and only a model judge can tell (``posttrain.curate.model_judge``).
Their key moves to ``meta["withheld_key"]`` so tests can still grade what curation kept.

Every record carries the answer key in ``meta`` (``answer``, ``verifier``, ``verifier_options``,
``group``, ``tier``, ``family``, ``task_prompt``) so a verifier stage can check responses, exactly
as a real flywheel checks verifiable tasks.
"""

from __future__ import annotations

import copy
import math
import random
import re
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from posttrain.tasks.problem import TASK_FAMILIES, Problem, allocate, sample_problems
from posttrain.tasks.words import WORDS, join_with_and

NOISE_KINDS = ("exact_duplicate", "near_duplicate", "garbled", "empty", "truncated", "wrong_answer", "off_topic")

# Instruction preambles. Each starts with a word from its own synonym set so a near-duplicate can
# change that first word (a one-word edit at the edge touches a single 5-word shingle).
PREAMBLES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("Please", "Kindly"), "read the short task below with care and reply with the answer only."),
    (("Carefully", "Attentively"), "solve the following small exercise and give just the final answer."),
    (("Now", "Next"), "here is one more question for you, so answer it as briefly as you can."),
    (("Task:", "Exercise:"), "follow the instruction that comes next and write nothing but the answer."),
    (("Quickly", "Promptly"), "work out the request below and keep your reply to the answer itself."),
    (("Simply", "Just"), "do what the next line asks and answer it in as few words as possible."),
)
_LEAD_INS = ("Okay,", "Alright,", "Well,", "So,")
_ANSWER_KEY = ("answer", "verifier", "verifier_options")


@dataclass(frozen=True)
class NoiseMix:
    """Share of the pool planted with each noise kind; the rest is clean. Counts use largest remainders."""

    exact_duplicate: float = 0.08
    near_duplicate: float = 0.08
    garbled: float = 0.05
    empty: float = 0.04
    truncated: float = 0.05
    wrong_answer: float = 0.10
    off_topic: float = 0.0

    def __post_init__(self) -> None:
        for kind, share in asdict(self).items():
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"NoiseMix.{kind} must be in [0, 1], got {share}")
        if sum(asdict(self).values()) > 0.9:
            raise ValueError(f"NoiseMix shares add up to {sum(asdict(self).values()):.2f}; keep them <= 0.9")

    def counts(self, n: int) -> dict[str, int]:
        """Exact number of records per kind (``clean`` included) in a pool of ``n``; they add up to ``n``."""
        shares = asdict(self)
        return allocate(n, {"clean": 1.0 - sum(shares.values()), **shares})


_WORD_SEPARATORS = re.compile(r"[\s!-/:-@\[-`{-~]+")  # ASCII whitespace and punctuation, as curate.minhash


def shingles(text: str, size: int = 5) -> set[tuple[str, ...]]:
    """Lowercased ``size``-word shingles; words are cut at ASCII whitespace and punctuation.

    The same word rule as ``posttrain.curate.minhash``, so "near-duplicate" means the same thing
    here and in the funnel. A text shorter than ``size`` words is one shingle.
    """
    words = [w for w in _WORD_SEPARATORS.split(text.lower()) if w]
    if len(words) < size:
        return {tuple(words)}
    return {tuple(words[i : i + size]) for i in range(len(words) - size + 1)}


def jaccard(a: str, b: str, size: int = 5) -> float:
    sa, sb = shingles(a, size), shingles(b, size)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


# Distinct problems whose prompts are this similar are not let into the same pool: the planted
# near-duplicates (>= 0.8) must be the only pairs a perfect near-dup filter would find.
DISTINCT_MAX_JACCARD = 0.7


class _ShingleIndex:
    """Inverted index of prompt shingles, to reject a record too similar to one already in the pool.

    Prefix filtering (Chaudhuri et al., "A primitive operator for similarity joins", ICDE 2006):
    ``J(A, B) >= t`` needs ``|A ∩ B| >= t|A|``, so B shares at least one of any
    ``|A| - floor(t|A|) + 1`` shingles of A. Looking up only A's rarest shingles finds every
    candidate without walking the long posting lists of the shared preambles.
    """

    def __init__(self) -> None:
        self._sets: list[set[tuple[str, ...]]] = []
        self._postings: dict[tuple[str, ...], list[int]] = {}

    def add_if_distinct(self, text: str) -> bool:
        mine = shingles(text)
        prefix_size = len(mine) - math.floor(DISTINCT_MAX_JACCARD * len(mine)) + 1
        rarest = sorted(mine, key=lambda s: (len(self._postings.get(s, ())), s))[:prefix_size]
        candidates = {j for s in rarest for j in self._postings.get(s, ())}
        for j in candidates:
            common = len(mine & self._sets[j])
            if common / (len(mine) + len(self._sets[j]) - common) >= DISTINCT_MAX_JACCARD:
                return False
        for s in mine:
            self._postings.setdefault(s, []).append(len(self._sets))
        self._sets.append(mine)
        return True


def _distinct_train_problems(count: int, seed: int) -> list[Problem]:
    """``count`` train problems with distinct keys, from as many families as can supply them.

    Small families (one word each) run out first in a large pool; more streams then top the pool up
    from the families that still have fresh problems, so the mix tilts towards them.
    """
    seen: set[str] = set()
    problems: list[Problem] = []
    for round_index in range(8):
        for problem in sample_problems(
            count, seed, split="train", unique=False, stream=f"raw_pool:{round_index}"
        ):
            if problem.key not in seen:
                seen.add(problem.key)
                problems.append(problem)
        if len(problems) >= count:
            break
    return problems[:count]


def raw_pool(
    n: int, seed: int, noise: NoiseMix | None = None, preamble_share: float = 1.0, unkeyed_share: float = 0.0
) -> list[dict[str, Any]]:
    """``n`` raw records (train split only), a ``noise`` share of them planted; shuffled, ids ``raw-000000``…

    Every duplicate comes after its source, so dedup keeping first occurrences drops exactly the
    planted copies. ``preamble_share`` < 1 leaves that share of the *clean* records with their bare
    task prompt (as users phrase them); planted records and near-duplicate sources keep the preamble,
    which is what makes a one-word edit a near-duplicate under 5-word shingles.
    """
    for name, share in (("preamble_share", preamble_share), ("unkeyed_share", unkeyed_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {share}")
    noise = noise or NoiseMix()
    counts = noise.counts(n)
    rng = random.Random(f"{seed}:raw_pool")
    n_own = n - counts["exact_duplicate"] - counts["near_duplicate"]  # records with a problem of their own
    pending = deque(_distinct_train_problems(n_own + n_own // 2 + 50, seed))
    index = _ShingleIndex()

    def take(kind: str) -> dict[str, Any]:
        # Drawn only when bare prompts are asked for, so the default pool stays what it always was.
        bare = kind == "clean" and preamble_share < 1.0 and rng.random() >= preamble_share
        for _ in range(len(pending)):
            problem = pending.popleft()
            if kind == "truncated" and len(problem.answer) < 2:  # nothing to cut: keep it for another kind
                pending.append(problem)
                continue
            record = _record(problem, rng, kind, bare=bare)
            if index.add_if_distinct(record["prompt"]):
                return record
        raise ValueError(f"raw_pool: ran out of distinct train problems for a pool of {n}; lower n")

    records: list[dict[str, Any]] = [take("truncated") for _ in range(counts["truncated"])]
    clean = [take("clean") for _ in range(counts["clean"])]
    records += clean
    records += [take(kind) for kind in ("garbled", "empty", "wrong_answer") for _ in range(counts[kind])]
    for _ in range(counts.get("off_topic", 0)):
        record = take("clean")
        # A fluent answer to a train problem of another family (one not used elsewhere in the pool).
        other = next(p for p in pending if p.family != record["meta"]["family"])
        record["response"] = other.answer
        record["meta"]["planted"] = "off_topic"
        records.append(record)
    if (counts["exact_duplicate"] or counts["near_duplicate"]) and not clean:
        raise ValueError("raw_pool: duplicates need clean records to copy; lower the noise shares or raise n")
    with_preamble = [r for r in clean if r["prompt"] != r["meta"]["task_prompt"]]
    if counts["near_duplicate"] and not with_preamble:
        raise ValueError("raw_pool: near-duplicates need clean records with a preamble; raise preamble_share")
    records += [_exact_duplicate(rng.choice(clean)) for _ in range(counts["exact_duplicate"])]
    records += [_near_duplicate(rng.choice(with_preamble), rng) for _ in range(counts["near_duplicate"])]

    records = _shuffle_sources_first(records, rng)
    for position, record in enumerate(records):
        record["id"] = f"raw-{position:06d}"
    if unkeyed_share:  # drawn last so a pool without it stays what it always was
        for record in records:
            if rng.random() < unkeyed_share:
                record["meta"]["withheld_key"] = {k: record["meta"].pop(k) for k in _ANSWER_KEY}
    final_id_of = {id(r): r["id"] for r in records}
    for record in records:  # duplicates point at their original by its final id
        source = record["meta"].pop("_source", None)
        if source is not None:
            record["meta"]["duplicate_of"] = final_id_of[id(source)]
    return records


def _shuffle_sources_first(records: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """A random order in which every duplicate comes after the record it copies.

    Dedup keeps the first record of a cluster, so with this order exactly the planted copies are
    the ones a correct funnel drops, and its report can be checked record by record.
    """
    time_of: dict[int, float] = {}
    for record in records:
        if "_source" not in record["meta"]:
            time_of[id(record)] = rng.random()
    for record in records:
        if "_source" in record["meta"]:
            start = time_of[id(record["meta"]["_source"])]
            time_of[id(record)] = start + (1.0 - start) * rng.random()
    return sorted(records, key=lambda record: time_of[id(record)])


def _topic(problem: Problem) -> str:
    """The numbers and vocabulary words of a problem, e.g. ``7 and 5`` or ``cat``.

    Mentioned in the preamble so two problems that differ in one number differ in two places, far
    enough apart that their prompts stay well below the near-duplicate threshold.
    """
    vocabulary = set(WORDS)
    seen: dict[str, None] = {}
    for token in re.findall(r"[A-Za-z]+|\d+", problem.prompt):
        if token.isdigit() or token.lower() in vocabulary:
            seen.setdefault(token.lower(), None)
    return join_with_and(list(seen)) if seen else problem.family.replace("_", " ")


def _record(problem: Problem, rng: random.Random, kind: str, bare: bool = False) -> dict[str, Any]:
    first_words, rest_of_preamble = rng.choice(PREAMBLES)
    task_prompt = problem.prompt
    response = problem.answer
    if kind == "garbled":
        task_prompt = garble(task_prompt, rng)
    elif kind == "empty":
        response = rng.choice(("", " ", "\n", "  \n"))
    elif kind == "truncated":
        response = truncate(problem.answer, rng)
    elif kind == "wrong_answer":
        response = TASK_FAMILIES[problem.family].wrong_answer(problem, rng)
    return {
        "id": "",
        "prompt": task_prompt if bare else f"{first_words[0]} {rest_of_preamble} This one is about {_topic(problem)}. {task_prompt}",
        "response": response,
        "tier": problem.tier,  # the generator knows it, as a labelled dataset would; curation keeps a given tier
        "meta": {
            "planted": None if kind == "clean" else kind,
            "group": problem.group,
            "tier": problem.tier,
            "family": problem.family,
            "task_prompt": problem.prompt,
            "answer": problem.answer,
            "verifier": problem.verifier,
            "verifier_options": copy.deepcopy(problem.options),
        },
    }


def _exact_duplicate(source: dict[str, Any]) -> dict[str, Any]:
    meta = {**copy.deepcopy(source["meta"]), "planted": "exact_duplicate", "_source": source}
    return {"id": "", "prompt": source["prompt"], "response": source["response"], "tier": source["tier"], "meta": meta}


def _near_duplicate(source: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    words = source["prompt"].split(" ")
    synonyms = next((options for options, _ in PREAMBLES if options[0] == words[0]), (words[0],))
    edits = [
        [rng.choice(_LEAD_INS), *words],  # a filler word added in front
        [*[w for w in synonyms if w != words[0]][:1], *words[1:]],  # the first word swapped for a synonym
    ]
    prompt = " ".join(rng.choice([e for e in edits if e != words]))
    meta = {**copy.deepcopy(source["meta"]), "planted": "near_duplicate", "_source": source}
    return {"id": "", "prompt": prompt, "response": source["response"], "tier": source["tier"], "meta": meta}


_MOJIBAKE = {"e": "Ã©", "a": "Ã¡", "o": "Ã³", "'": "â€™", " ": " â€“ ", "u": "Ã¼"}


def garble(text: str, rng: random.Random) -> str:
    """Corrupt ``text`` the way broken encodings do: mojibake sequences or U+FFFD replacement characters."""
    if rng.random() < 0.5:
        chars = [_MOJIBAKE[c] if c in _MOJIBAKE and rng.random() < 0.6 else c for c in text]
    else:
        chars = ["\ufffd" if c.isalnum() and rng.random() < 0.35 else c for c in text]
    garbled = "".join(chars)
    return garbled if garbled != text else text + " \ufffd\ufffd"


def truncate(answer: str, rng: random.Random) -> str:
    """Cut ``answer`` short: drop trailing words when it has several, else trailing characters."""
    for separator in ("\n", " "):  # whole lines first (bullet lists), then whole words
        parts = answer.split(separator)
        if len(parts) > 1:
            return separator.join(parts[: rng.randint(1, len(parts) - 1)])
    return answer[: rng.randint(1, len(answer) - 1)]
