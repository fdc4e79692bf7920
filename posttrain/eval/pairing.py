"""Pair the items of two ``posttrain eval`` results: the same id *and* the same content.

An id names an item; it does not prove two runs asked the same question. Results store each item's
``content_hash`` (``posttrain.eval.items.content_hash``: prompt, answer key, tests, verifier and its
options), and two items pair only when id and hash agree. Items that share an id but not the content
are set apart and reported, never compared. Results written before hashes were stored are matched on
the prompt and answer they do store (tests and verifier options are then unchecked), and rows that
store neither are matched by id alone; ``Pairing.notes`` says which check was made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.eval.items import content_hash

CONTENT_HASH = "content hash"
STORED_FIELDS = "stored prompt and answer"
ID_ONLY = "id only"


class IncomparableResults(ValueError):
    """Two results that share no item to compare (no common id, or every common id changed content)."""


@dataclass
class Pairing:
    pairs: list[tuple[dict, dict]]
    only_in_base: list[str]
    only_in_new: list[str]
    changed: list[str]  # shared ids whose content differs: left out
    checked_by: str  # CONTENT_HASH, STORED_FIELDS or ID_ONLY
    without_hashes: list[str] = field(default_factory=list)  # "BASE" / "NEW": results that store no hashes

    @property
    def notes(self) -> list[str]:
        """Plain-language lines about what was paired and what was left out."""
        lines = []
        if self.changed:
            shown = ", ".join(self.changed[:5]) + (", ..." if len(self.changed) > 5 else "")
            lines.append(f"{len(self.changed)} items share an id but differ in prompt, tests or answer (checked by "
                         f"{self.checked_by}) and were left out: {shown}.")
        if self.without_hashes:
            sides = " and ".join(self.without_hashes)
            check = ("their stored prompt, answer and verifier; tests and verifier options were not checked"
                     if self.checked_by == STORED_FIELDS else
                     "id only; nothing shows that the runs asked the same questions")
            verb = "holds" if len(self.without_hashes) == 1 else "hold"
            lines.append(f"Note: {sides} {verb} no content hashes (written by an older `posttrain eval`), so items "
                         f"were matched by {check}. Re-run `posttrain eval` to compare by content.")
        dropped = len(self.only_in_base) + len(self.only_in_new)
        if dropped:
            lines.append(f"Compared {len(self.pairs)} items present in both runs; {len(self.only_in_base)} only in "
                         f"BASE and {len(self.only_in_new)} only in NEW were left out of the comparison.")
        return lines


def _stored_content(row: dict) -> str:
    return content_hash(row["prompt"], row.get("answer"), verifier=row.get("verifier"))


def pair_results(base_items: list[dict], new_items: list[dict]) -> Pairing:
    """Pair result rows by id and content; raise ``IncomparableResults`` when nothing pairs."""
    base = {str(row["id"]): row for row in base_items}
    new = {str(row["id"]): row for row in new_items}
    without = [name for name, rows in (("BASE", base_items), ("NEW", new_items))
               if not all("content_hash" in row for row in rows)]
    if not without:
        checked_by, key = CONTENT_HASH, (lambda row: row["content_hash"])
    elif all("prompt" in row for row in (*base_items, *new_items)):
        checked_by, key = STORED_FIELDS, _stored_content
    else:
        checked_by, key = ID_ONLY, (lambda row: None)
    shared = [item_id for item_id in base if item_id in new]
    if not shared:
        raise IncomparableResults("the two results share no item ids, so there is nothing to compare (were they "
                                  "run on the same suite?)")
    changed = [item_id for item_id in shared if key(base[item_id]) != key(new[item_id])]
    if len(changed) == len(shared):
        raise IncomparableResults(
            f"all {len(shared)} item ids the two results share differ in prompt, tests or answer (checked by "
            f"{checked_by}; first: {', '.join(changed[:3])}): they were not run on the same suite, so there is "
            "nothing to compare")
    unchanged = set(shared) - set(changed)
    return Pairing(
        pairs=[(base[i], new[i]) for i in shared if i in unchanged],
        only_in_base=sorted(set(base) - set(new)),
        only_in_new=sorted(set(new) - set(base)),
        changed=changed,
        checked_by=checked_by,
        without_hashes=without,
    )
