"""The tasks' answers are judged by the real eval verifiers, exactly as evaluation will judge a model."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.eval.items import EvalItem
from posttrain.eval.verifiers import check_item
from posttrain.eval.verifiers import verify as run_verifier


def verify_response(verifier: str, response: str, answer: str | None, options: dict[str, Any]) -> bool:
    item = EvalItem(id="under-test", prompt="-", verifier=verifier, answer=answer, options=options)
    problem = check_item(item)
    assert problem is None, f"the verifier refuses the item's options: {problem}"
    return run_verifier(item, response).passed


@pytest.fixture(scope="session")
def verify():
    """``verify(verifier, response, answer, options) -> bool`` through ``posttrain.eval.verifiers``."""
    return verify_response
