"""Fixtures of the cloud tests (the S3 server itself is tests/conftest.py's ``s3_endpoint``)."""

import pytest

from tests.train.conftest import make_sft_jsonl


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory) -> str:
    return str(make_sft_jsonl(tmp_path_factory.mktemp("sftdata") / "train.jsonl"))
