"""The digest cache: an unchanged file is not read again, any change of status reads it again, and a file that
may still be changing (racy, or changed while read) is never cached."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from posttrain import cache
from posttrain.cache import cache_dir, stat_cached_digest
from posttrain.data.storage import source_fingerprint
from posttrain.train import reference
from posttrain.train.reference import model_digest


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-home"))


def settled(path, age_s: float = 60.0) -> None:
    """Give ``path`` a modification time well outside the racy window, as any file not just written has."""
    when = time.time() - age_s
    os.utime(path, (when, when))


def counted(path):
    calls = []

    def compute():
        calls.append(1)
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return compute, calls


def test_an_unchanged_file_is_hashed_once_and_a_rewrite_of_the_same_size_is_seen(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 4096)
    settled(path)
    compute, calls = counted(path)
    first = stat_cached_digest("t", [path], compute)
    assert stat_cached_digest("t", [path], compute) == first == hashlib.sha256(b"a" * 4096).hexdigest()
    assert len(calls) == 1
    path.write_bytes(b"b" * 4096)  # same size, same inode, a new modification time
    settled(path, age_s=30)
    assert stat_cached_digest("t", [path], compute) == hashlib.sha256(b"b" * 4096).hexdigest()
    assert len(calls) == 2
    assert stat_cached_digest("other kind", [path], compute) and len(calls) == 3  # kinds never share entries


def test_a_file_modified_within_the_racy_window_is_not_cached(tmp_path):
    path = tmp_path / "fresh.bin"
    path.write_bytes(b"x")  # modified just now: a write in the same timestamp tick could follow unseen
    compute, calls = counted(path)
    stat_cached_digest("t", [path], compute)
    stat_cached_digest("t", [path], compute)
    assert len(calls) == 2 and not (cache_dir("digests")).exists()


def test_a_file_that_changes_while_it_is_read_is_not_cached(tmp_path):
    path = tmp_path / "moving.bin"
    path.write_bytes(b"old")
    settled(path)
    stat_before = os.stat(path)

    def compute_while_a_writer_appends():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        path.write_bytes(b"old and new")
        os.utime(path, ns=(stat_before.st_atime_ns, stat_before.st_mtime_ns))  # even the old mtime: the size moved
        return digest

    stat_cached_digest("t", [path], compute_while_a_writer_appends)
    compute, calls = counted(path)
    assert stat_cached_digest("t", [path], compute) == hashlib.sha256(b"old and new").hexdigest()
    assert len(calls) == 1


def test_an_unwritable_cache_costs_a_read_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    path = tmp_path / "w.bin"
    path.write_bytes(b"w")
    settled(path)
    compute, calls = counted(path)
    assert stat_cached_digest("t", [path], compute) == stat_cached_digest("t", [path], compute)
    assert len(calls) == 2


def _model_dir(root, files: dict[str, bytes]):
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
        settled(root / name)
    return root


def test_the_model_digest_keeps_its_value_and_is_not_reread(tmp_path, monkeypatch):
    files = {"config.json": b"{}", "model.safetensors": b"\0" * 10000, "README.md": b"not a model file"}
    root = _model_dir(tmp_path / "m", files)
    expected = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):  # the rule before the cache: names and bytes, in order
        expected.update(name.encode())
        expected.update(files[name])
    reads = []
    real = reference._hash_stream
    monkeypatch.setattr(reference, "_hash_stream", lambda digest, handle: (reads.append(1), real(digest, handle)))
    assert model_digest(str(root)) == expected.hexdigest()
    assert len(reads) == 2
    assert model_digest(str(root)) == expected.hexdigest() and len(reads) == 2  # nothing read the second time
    (root / "model.safetensors").write_bytes(b"\1" * 10000)
    settled(root / "model.safetensors", age_s=5)
    assert model_digest(str(root)) != expected.hexdigest()


def test_the_same_bytes_under_other_names_are_another_model(tmp_path):
    first = _model_dir(tmp_path / "a", {"config.json": b"{}", "model.safetensors": b"w"})
    second = tmp_path / "b"
    second.mkdir()
    (second / "config.json").symlink_to(first / "config.json")
    (second / "model-00001.safetensors").symlink_to(first / "model.safetensors")  # same target, other name
    assert model_digest(str(first)) != model_digest(str(second))


def test_a_local_data_fingerprint_is_cached_and_sees_a_change(tmp_path, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text('{"a": 1}\n')
    settled(data)
    reads = []
    real = cache.stat_cached_digest
    monkeypatch.setattr("posttrain.data.storage.stat_cached_digest",
                        lambda kind, paths, compute: real(kind, paths, lambda: (reads.append(1), compute())[1]))
    first = source_fingerprint(str(data))
    assert source_fingerprint(str(data)) == first and len(reads) == 1
    data.write_text('{"a": 2}\n')
    settled(data, age_s=5)
    assert source_fingerprint(str(data))["digest"] != first["digest"] and len(reads) == 2
