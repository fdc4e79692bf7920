"""`posttrain report s3://…`: a run in object storage is reported from its small files alone, and the report is
the one its local copy gives, with the URL in place of the directory."""

from __future__ import annotations

import json
from pathlib import Path

import s3fs

from posttrain.cli import main
from posttrain.report.remote import MAX_FILE_BYTES, fetch_report_files


def upload(local: Path, url: str) -> None:
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{url}/{path.relative_to(local).as_posix()}")


def without_location(numbers: dict, where: str) -> dict:
    """The report's numbers with its own location blanked (the one field that must differ)."""
    text = json.dumps(numbers).replace(where, "<RUN>")
    return json.loads(text)


def test_a_remote_run_reports_as_its_local_copy_without_fetching_weights(finished_run, s3_bucket, tmp_path, capsys):
    run_dir, _ = finished_run
    url = f"{s3_bucket}/runs/quickstart"
    upload(run_dir, url)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.pipe_file(f"{url}/sft/checkpoints/step-000002/__0_0.distcp", b"\0" * 1024)  # weights: never fetched
    fs.pipe_file(f"{url}/sft/metrics.jsonl.tmp-1a2b", b"{not json")  # a write that never committed
    fs.pipe_file(f"{url}/previous-20261201T000000Z/metrics.jsonl", b"{}")  # a run moved aside

    fetched = fetch_report_files(url, tmp_path / "copy")
    names = {p.relative_to(fetched).as_posix() for p in fetched.rglob("*") if p.is_file()}
    assert "sft/metrics.jsonl" in names and "curate/funnel.json" in names
    assert not any(n.startswith(("previous-",)) or "/checkpoints/" in n or ".tmp" in n for n in names), names
    assert all(n.endswith((".json", ".jsonl", ".yaml")) for n in names)
    assert all((fetched / n).stat().st_size <= MAX_FILE_BYTES for n in names)

    for stage in ("", "/sft", "/curate"):
        name = stage.replace("/", "-")
        local_out, remote_out = tmp_path / f"local{name}.html", tmp_path / f"remote{name}.html"
        assert main(["report", str(run_dir) + stage, "--out", str(local_out)]) == 0
        assert main(["report", url + stage, "--out", str(remote_out)]) == 0
        local = json.loads(local_out.with_suffix(".json").read_text())
        remote = json.loads(remote_out.with_suffix(".json").read_text())
        assert remote["run_dir"] == url + stage
        assert without_location(remote, url + stage) == without_location(local, str(run_dir) + stage)
        page = remote_out.read_text()
        assert url + stage in page and "posttrain-report-" not in page  # the URL shown, not the temporary copy


def test_the_default_output_is_the_current_directory_and_a_missing_run_is_one_line(s3_bucket, tmp_path, monkeypatch,
                                                                                    capsys, finished_run):
    run_dir, _ = finished_run
    upload(run_dir / "sft", f"{s3_bucket}/my-sft-run")
    monkeypatch.chdir(tmp_path)
    assert main(["report", f"{s3_bucket}/my-sft-run/"]) == 0
    assert (tmp_path / "my-sft-run.report.html").is_file() and (tmp_path / "my-sft-run.report.json").is_file()
    capsys.readouterr()
    assert main(["report", f"{s3_bucket}/no-such-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-run" in err[0] and "Traceback" not in err[0], err
