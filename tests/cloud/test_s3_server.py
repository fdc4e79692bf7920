"""The loopback S3 server the cloud tests use answers like S3: bytes written come back, listings see them."""

import s3fs


def test_loopback_s3_round_trip(s3_bucket):
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    path = s3_bucket.removeprefix("s3://") + "/run/a.bin"
    payload = bytes(range(256)) * 4096
    with fs.open(path, "wb") as handle:
        handle.write(payload)
    assert fs.cat_file(path) == payload
    assert fs.ls(s3_bucket.removeprefix("s3://") + "/run") == [path]
