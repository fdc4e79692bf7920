"""What a read of a record file did (``ReadReport``), and whether what it accepted can be trained on.

``posttrain.data.io.read_records`` fills one report per file; ``ReadReport.check_usable`` is the one
rule for "this file is not training data": nothing accepted, or more than half of it quarantined
(``MAX_QUARANTINED_SHARE``). The rule needs no config: quarantine is for the odd broken record, and a
file that is mostly rejected is in the wrong format or meant for another recipe, which no amount of
training on the remainder fixes. The error says why the records were refused, which format they were
detected as, and how to check or convert them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.errors import DataError

MAX_QUARANTINED_SHARE = 0.5  # a run stops when more than this share of the records read was quarantined
_EXAMPLE_LINES_PER_REASON = 5
_TOP_REASONS = 3


@dataclass
class ReadReport:
    """What a read did. Invariant: ``read == accepted + quarantined``.

    ``reasons`` counts bad records by category; ``example_lines`` keeps the first few line numbers of
    each category and ``first_reasons`` the first full reason, so a person can go and look.
    ``formats`` counts the formats of accepted records, ``detected`` the formats recognised in every
    record read (quarantined ones included: an RL prompt refused by SFT is still detected as ``rl``).
    ``blank_lines`` are whitespace-only lines, which hold no record and are not counted as read.
    """

    path: str
    read: int = 0
    accepted: int = 0
    quarantined: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    formats: Counter[str] = field(default_factory=Counter)
    detected: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    example_lines: dict[str, list[int | str]] = field(default_factory=lambda: defaultdict(list))
    first_reasons: dict[str, str] = field(default_factory=dict)
    blank_lines: int = 0
    quarantine_path: str | None = None
    kind: str | None = None  # the record kind the reader asked for

    def add_bad(self, category: str, line: int | str | None, reason: str | None = None) -> None:
        self.quarantined += 1
        self.reasons[category] += 1
        if line is not None and len(self.example_lines[category]) < _EXAMPLE_LINES_PER_REASON:
            self.example_lines[category].append(line)
        if reason and category not in self.first_reasons:
            self.first_reasons[category] = reason

    def merge(self, other: ReadReport, label: str | None = None) -> None:
        """Add the counts of ``other`` (the read of one shard); ``label`` (the shard's file name) prefixes
        its example lines, so ``train-00003.parquet:17`` says where to look in a shard set."""
        self.read += other.read
        self.accepted += other.accepted
        self.quarantined += other.quarantined
        self.blank_lines += other.blank_lines
        for mine, theirs in ((self.reasons, other.reasons), (self.formats, other.formats),
                             (self.detected, other.detected), (self.kinds, other.kinds)):
            mine.update(theirs)
        for category, lines in other.example_lines.items():
            kept = self.example_lines[category]
            kept += [f"{label}:{line}" if label else line for line in lines][: _EXAMPLE_LINES_PER_REASON - len(kept)]
        for category, reason in other.first_reasons.items():
            self.first_reasons.setdefault(category, f"{label}: {reason}" if label else reason)

    def summary(self) -> str:
        text = f"{self.path}: read {self.read} = accepted {self.accepted} + quarantined {self.quarantined}"
        if self.reasons:
            text += " (" + ", ".join(f"{reason}: {count}" for reason, count in self.reasons.most_common()) + ")"
        if self.quarantined:
            text += f" -> {self.quarantine_path}" if self.quarantine_path else " (not saved)"
        if self.blank_lines:
            text += f"; {self.blank_lines} blank line(s) skipped"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "read": self.read,
            "accepted": self.accepted,
            "quarantined": self.quarantined,
            "reasons": dict(self.reasons),
            "formats": dict(self.formats),
            "detected": dict(self.detected),
            "kinds": dict(self.kinds),
            "example_lines": dict(self.example_lines),
            "first_reasons": dict(self.first_reasons),
            "blank_lines": self.blank_lines,
            "quarantine_path": self.quarantine_path,
        }

    def check_usable(self, what: str = "training set") -> None:
        """Raise a one-line ``DataError`` when nothing was accepted or more than half was quarantined.

        ``what`` names the data in the message ("training set", "eval set").
        """
        if self.read == 0:
            blank = f" ({self.blank_lines} blank lines)" if self.blank_lines else ""
            raise DataError(self.path, None, None, f"the {what} is empty: the file holds no records{blank}")
        if self.accepted and self.quarantined <= MAX_QUARANTINED_SHARE * self.read:
            return
        if self.accepted == 0:
            head = f"the {what} is empty: all {self.read} records read were quarantined"
        else:
            head = (f"the {what} is mostly unusable: {self.quarantined} of {self.read} records read "
                    f"({self.quarantined / self.read:.0%}) were quarantined")
        rule = ("a run stops when more than half of a file is quarantined: the file is then in the wrong format or "
                "meant for another recipe, not just noisy")
        reasons = "; ".join(self._reason(category, count) for category, count in self.reasons.most_common(_TOP_REASONS))
        unmatched = self.read - sum(self.detected.values())
        if self.detected:
            detected = ", ".join(f"{name} ({count})" for name, count in self.detected.most_common())
            detected += f", no known format ({unmatched})" if unmatched else ""
        else:
            detected = "none (no record matched a known format)"
        kind = f" --kind {self.kind}" if self.kind else ""
        saved = f"; every quarantined record and its reason: {self.quarantine_path}" if self.quarantine_path else ""
        raise DataError(self.path, None, None, (
            f"{head} ({rule}). Top reasons: {reasons}. Detected format: {detected}{saved}. Check the file with "
            f"`posttrain data inspect {self.path}{kind} --on-error quarantine`; the formats each recipe reads "
            "and how to convert them are in docs/data.md."
        ))

    def _reason(self, category: str, count: int) -> str:
        lines = self.example_lines.get(category)
        where = f" (lines {', '.join(map(str, lines))})" if lines else ""
        first = self.first_reasons.get(category)
        return f"{category}: {count}{where}" + (f": {first}" if first else "")
