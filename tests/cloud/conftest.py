"""Fixtures of the cloud tests (the S3 server itself is tests/conftest.py's ``s3_endpoint``)."""

import pytest

from tests.train.conftest import make_sft_jsonl


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory) -> str:
    return str(make_sft_jsonl(tmp_path_factory.mktemp("sftdata") / "train.jsonl"))


@pytest.fixture(autouse=True)
def _forget_cached_s3_clients():
    """fsspec caches one S3FileSystem per set of options, not per endpoint: a client made while a test pointed
    AWS_ENDPOINT_URL at a fault proxy would outlive the proxy and serve the next test in this process."""
    yield
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
