"""Stage 1, normalisation: Unicode NFC, tidy whitespace, strip control characters.

Normalisation never drops a row; it rewrites message contents so that later stages (exact dedup
in particular) see one spelling of the same text. The number of control characters it removed is
kept on the row, because a text that was mostly control characters is garbled and the quality
filters drop it.
"""

from __future__ import annotations

import re
import unicodedata

from posttrain.curate.config import CurateRecipe, NormalizeConfig
from posttrain.curate.registry import CURATION_STAGES
from posttrain.curate.rows import Drop, Row

# Cc (control) and Cf (format: zero-width spaces, BOM, bidi marks) characters other than \n and \t.
_CONTROL = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2064\ufeff\ufff9-\ufffb]"
)
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]+")
_TRAILING = re.compile(r"[ \t]+\n")


def count_control_characters(text: str) -> int:
    return len(_CONTROL.findall(text))


def normalize_text(text: str, config: NormalizeConfig) -> tuple[str, int]:
    """Return ``(normalised text, control characters removed)``."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    removed = 0
    if config.strip_control:
        text, removed = _CONTROL.subn("", text)
    text = unicodedata.normalize(config.unicode_form, text)
    if config.collapse_spaces:
        text = _SPACES.sub(" ", text)
        text = _TRAILING.sub("\n", text)
    blank_run = "\n" * (config.max_blank_lines + 2)
    if blank_run in text:
        text = re.sub(f"\n{{{config.max_blank_lines + 2},}}", "\n" * (config.max_blank_lines + 1), text)
    return text.strip(), removed


class NormalizeStage:
    name = "normalize"

    def __init__(self, config: NormalizeConfig):
        self.config = config

    def apply(self, rows: list[Row]) -> list[Drop | None]:
        for row in rows:
            total = 0
            for message in row.messages:
                message["content"], removed = normalize_text(message["content"], self.config)
                total += removed
            row.raw_control_chars = total
        return [None] * len(rows)


@CURATION_STAGES.register("normalize")
def _normalize_stage(recipe: CurateRecipe, cache_dir: str | None) -> NormalizeStage:
    return NormalizeStage(recipe.normalize)
