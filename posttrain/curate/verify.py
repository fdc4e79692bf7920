"""Verifier stage: a record whose ``meta`` carries an answer key is checked like an eval item.

The built-in task pool (``posttrain.tasks.pool``) and many real flywheel sources know the answer to
their prompts; a response that fails its verifier is wrong data however fluent it reads, so it is
dropped (``verifier_failed``) before any judge spends time on it. Records without an answer key
pass untouched. A key the verifiers cannot use is reported as ``verifier_error``.
"""

from __future__ import annotations

from posttrain.curate.config import CurateRecipe
from posttrain.curate.registry import CURATION_STAGES
from posttrain.curate.rows import Drop, Row


class VerifyStage:
    name = "verify"

    def apply(self, rows: list[Row]) -> list[Drop | None]:
        from pydantic import ValidationError

        from posttrain.eval.items import EvalItem
        from posttrain.eval.verifiers import check_item, verify

        results: list[Drop | None] = []
        for row in rows:
            name = row.meta.get("verifier")
            if not name:
                results.append(None)
                continue
            try:
                item = EvalItem(
                    id=row.id,
                    prompt=row.prompt,
                    verifier=str(name),
                    answer=row.meta.get("answer"),
                    tests=row.meta.get("tests"),
                    options=row.meta.get("verifier_options") or row.meta.get("options") or {},
                )
            except ValidationError as exc:
                results.append(Drop("verifier_error", str(exc.errors()[0]["msg"])))
                continue
            problem = check_item(item)
            if problem:
                results.append(Drop("verifier_error", f"{problem[0]}: {problem[1]}"))
                continue
            outcome = verify(item, row.response)
            row.scores["verifier"] = outcome.score
            results.append(None if outcome.passed else Drop("verifier_failed", outcome.detail[:200]))
        return results


@CURATION_STAGES.register("verify")
def _verify_stage(recipe: CurateRecipe, cache_dir: str | None) -> VerifyStage:
    return VerifyStage()
