"""Stage 2, heuristic quality filters: each rule is a pure function of a row's text and the config.

The rules and their defaults come from published rule sets, adapted to instruction/response pairs:

- Gopher (Rae et al. 2021, "Scaling Language Models: Methods, Analysis & Insights from Training
  Gopher", appendix A): symbol-to-word ratio, mean word length, share of words with a letter,
  duplicate-line fractions, top n-gram and duplicate n-gram character fractions.
- C4 (Raffel et al. 2020): boilerplate phrases such as "lorem ipsum".
- FineWeb (Penedo et al. 2024) uses the same Gopher repetition rules; its fixes for short texts
  are why repetition rules here only apply to texts with ``repetition_min_words`` or more words.
- Departures, calibrated on real answer-length text (``posttrain.curate.calibrate``: Python's
  documentation and Debian package descriptions, where Gopher's limits dropped 6.5 % of clean
  records): word statistics count only tokens with a letter or digit, so table borders (``+----+``,
  ``|``) and bullets are not "words", and repeated lines count only lines with a letter or digit;
  and each repetition limit gets a length-aware allowance of ``repetition_allowance`` coincidental
  repeats (see ``repetition_limit``). Gopher's limits were set on web documents of hundreds to
  thousands of words, where a technical phrase used twice is a negligible share; in a 100-word answer
  it is 10 %. The allowance shrinks as ``1/W``, so long texts meet Gopher's limits unchanged.
- Garbled text: U+FFFD replacement characters, mojibake (UTF-8 decoded as Latin-1/CP-1252, as in
  ftfy's detectors), control characters counted before normalisation.

A rule returns ``None`` to keep the row or a ``Drop`` naming the rule. Rules live in ``FILTERS``, a
registry that rejects duplicate names; the stage runs them in registration order and stops at the
first that fires, so each dropped row has exactly one reason.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

from posttrain.curate.config import CurateRecipe, FiltersConfig
from posttrain.curate.registry import CURATION_STAGES
from posttrain.curate.rows import Drop, Row

FilterRule = Callable[[Row, FiltersConfig], Drop | None]
FILTERS: dict[str, FilterRule] = {}

_WORD = re.compile(r"\S+")
# UTF-8 bytes of common accented letters and punctuation read as Latin-1/CP-1252.
_MOJIBAKE = re.compile("Ã[\u0080-\u00bf]|Ã[©¨ª«¡¢£¤¥¦§­®¯°±²³´µ¶·¸¹º»¼½¾¿]|â€[™œ\u009d“”˜¦¢]|Â[\u00a0-\u00bf]")


def register_filter(name: str) -> Callable[[FilterRule], FilterRule]:
    def wrap(rule: FilterRule) -> FilterRule:
        if name in FILTERS:
            raise ValueError(f"filter {name!r} is already registered")
        FILTERS[name] = rule
        return rule

    return wrap


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def content_words(tokens: list[str]) -> list[str]:
    """The ``words`` with at least one letter or digit (not ``|``, ``+---+``, ``*``, ``...``)."""
    return [token for token in tokens if any(c.isalnum() for c in token)]


# -- shape -----------------------------------------------------------------------------------
@register_filter("length")
def length_rule(row: Row, config: FiltersConfig) -> Drop | None:
    prompt, response = len(row.prompt), len(row.response)
    if config.min_prompt_chars is not None and prompt < config.min_prompt_chars:
        return Drop("empty_prompt" if prompt == 0 else "prompt_too_short", f"{prompt} chars")
    if config.max_prompt_chars is not None and prompt > config.max_prompt_chars:
        return Drop("prompt_too_long", f"{prompt} chars > {config.max_prompt_chars}")
    if config.min_response_chars is not None and response < config.min_response_chars:
        return Drop("empty_response" if response == 0 else "response_too_short", f"{response} chars")
    if config.max_response_chars is not None and response > config.max_response_chars:
        return Drop("response_too_long", f"{response} chars > {config.max_response_chars}")
    return None


@register_filter("prompt_equals_response")
def prompt_equals_response_rule(row: Row, config: FiltersConfig) -> Drop | None:
    if config.drop_prompt_equals_response and row.prompt.strip().casefold() == row.response.strip().casefold():
        return Drop("prompt_equals_response")
    return None


# -- garbled text ----------------------------------------------------------------------------
def replacement_char_ratio(text: str) -> float:
    return text.count("\ufffd") / max(len(text), 1)


def mojibake_ratio(text: str) -> float:
    return len(_MOJIBAKE.findall(text)) / max(len(words(text)), 1)


@register_filter("garbled")
def garbled_rule(row: Row, config: FiltersConfig) -> Drop | None:
    text = row.text("both")
    if config.max_replacement_char_ratio is not None:
        ratio = replacement_char_ratio(text)
        if ratio > config.max_replacement_char_ratio:
            return Drop("garbled_replacement_chars", f"{ratio:.3f} U+FFFD per char")
    if config.max_mojibake_ratio is not None:
        ratio = mojibake_ratio(text)
        if ratio > config.max_mojibake_ratio:
            return Drop("garbled_mojibake", f"{ratio:.3f} mojibake sequences per word")
    if config.max_nonprintable_ratio is not None:
        ratio = row.raw_control_chars / max(len(text) + row.raw_control_chars, 1)
        if ratio > config.max_nonprintable_ratio:
            return Drop("garbled_nonprintable", f"{ratio:.3f} control chars per char")
    return None


# -- Gopher quality rules --------------------------------------------------------------------
def symbol_word_ratio(text: str, n_words: int) -> float:
    return (text.count("#") + text.count("...") + text.count("…")) / max(n_words, 1)


@register_filter("symbols_and_words")
def symbols_and_words_rule(row: Row, config: FiltersConfig) -> Drop | None:
    text = row.text("both")
    tokens = words(text)
    if not tokens:
        return None  # the length rule owns empty texts
    if config.max_symbol_word_ratio is not None:
        ratio = symbol_word_ratio(text, len(tokens))
        if ratio > config.max_symbol_word_ratio:
            return Drop("symbol_word_ratio", f"{ratio:.2f} > {config.max_symbol_word_ratio}")
    content = content_words(tokens)  # the tokens already split, not a second pass over the text
    mean = sum(map(len, content)) / len(content) if content else 0.0
    if config.min_mean_word_length is not None and mean < config.min_mean_word_length:
        return Drop("mean_word_length_low", f"{mean:.1f} < {config.min_mean_word_length}")
    if config.max_mean_word_length is not None and mean > config.max_mean_word_length:
        return Drop("mean_word_length_high", f"{mean:.1f} > {config.max_mean_word_length}")
    if config.min_alpha_word_ratio is not None:
        alpha = sum(any(c.isalpha() for c in token) for token in tokens) / len(tokens)
        if alpha < config.min_alpha_word_ratio:
            return Drop("alpha_word_ratio", f"{alpha:.2f} < {config.min_alpha_word_ratio}")
    return None


def duplicate_line_fractions(text: str) -> tuple[float, float]:
    """(share of lines that repeat an earlier line, share of characters in them), over lines with a
    letter or digit (a table's border lines repeat by design)."""
    lines = [line.strip() for line in text.split("\n") if any(c.isalnum() for c in line)]
    if not lines:
        return 0.0, 0.0
    seen: set[str] = set()
    dup_lines = dup_chars = 0
    for line in lines:
        if line in seen:
            dup_lines += 1
            dup_chars += len(line)
        seen.add(line)
    return dup_lines / len(lines), dup_chars / max(sum(map(len, lines)), 1)


def top_ngram_char_fraction(tokens: list[str], n: int) -> float:
    """Characters covered by the most frequent word n-gram (each occurrence counted) / all characters."""
    grams = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    if not grams:
        return 0.0
    gram, count = grams.most_common(1)[0]
    if count < 2:
        return 0.0
    return count * sum(map(len, gram)) / max(sum(map(len, tokens)), 1)


def duplicate_ngram_char_fraction(tokens: list[str], n: int) -> float:
    """Characters of words inside n-grams that occur more than once / all characters (Gopher)."""
    if len(tokens) < n:
        return 0.0
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    counts = Counter(grams)
    covered = [False] * len(tokens)
    for start, gram in enumerate(grams):
        if counts[gram] > 1:
            for position in range(start, start + n):
                covered[position] = True
    total = sum(map(len, tokens))
    return sum(len(t) for t, hit in zip(tokens, covered, strict=True) if hit) / max(total, 1)


def repetition_limit(limit: float, n: int, n_words: int, allowance: float, kind: str) -> float:
    """Gopher's ``limit`` for ``n``-grams, raised for a text of ``n_words`` words by ``allowance``
    coincidental repeats: ``allowance · 2n / W`` for duplicate n-grams (that many phrases of n words,
    each said twice) and ``allowance · n / W`` for the top n-gram (that many extra occurrences).
    Character fractions are approximated by word fractions; ``allowance = 0`` is Gopher's rule."""
    per_repeat = 2 * n if kind == "duplicate" else n
    return limit + allowance * per_repeat / max(n_words, 1)


@register_filter("repetition")
def repetition_rule(row: Row, config: FiltersConfig) -> Drop | None:
    allowance = config.repetition_allowance
    for part, text in (("response", row.response), ("prompt", row.prompt)):
        tokens = content_words(words(text))
        if len(tokens) < config.repetition_min_words:
            continue
        lines, chars = duplicate_line_fractions(text)
        if config.max_duplicate_line_fraction is not None and lines > config.max_duplicate_line_fraction:
            return Drop("duplicate_lines", f"{part}: {lines:.2f} of lines repeat")
        if config.max_duplicate_line_char_fraction is not None and chars > config.max_duplicate_line_char_fraction:
            return Drop("duplicate_lines", f"{part}: {chars:.2f} of chars in repeated lines")
        lowered = [t.lower() for t in tokens]
        for n, limit in sorted(config.max_top_ngram_char_fraction.items()):
            fraction = top_ngram_char_fraction(lowered, n)
            allowed = repetition_limit(limit, n, len(tokens), allowance, "top")
            if fraction > allowed:
                return Drop("top_ngram_repetition", f"{part}: top {n}-gram covers {fraction:.2f} > {allowed:.2f}")
        for n, limit in sorted(config.max_duplicate_ngram_char_fraction.items()):
            fraction = duplicate_ngram_char_fraction(lowered, n)
            allowed = repetition_limit(limit, n, len(tokens), allowance, "duplicate")
            if fraction > allowed:
                return Drop("duplicate_ngram_repetition", f"{part}: repeated {n}-grams cover {fraction:.2f} > {allowed:.2f}")
    return None


@register_filter("banned_phrases")
def banned_phrase_rule(row: Row, config: FiltersConfig) -> Drop | None:
    if not config.banned_phrases:
        return None
    text = row.text("both").casefold()
    for phrase in config.banned_phrases:
        if phrase.casefold() in text:
            return Drop("banned_phrase", phrase)
    return None


class FilterStage:
    name = "filters"

    def __init__(self, config: FiltersConfig):
        self.config = config

    def apply(self, rows: list[Row]) -> list[Drop | None]:
        results: list[Drop | None] = []
        for row in rows:
            verdict = None
            for rule in FILTERS.values():
                verdict = rule(row, self.config)
                if verdict is not None:
                    break
            results.append(verdict)
        return results


@CURATION_STAGES.register("filters")
def _filters_stage(recipe: CurateRecipe, cache_dir: str | None) -> FilterStage:
    return FilterStage(recipe.filters)
