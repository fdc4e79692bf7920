"""`posttrain k8s render` ships only what a pod can reach: a local model directory or data file in the recipe is
refused naming its key (or kept, with a warning, under --allow-local-paths), URLs and hub ids render, and the
image is one the user names."""

from __future__ import annotations

import pytest

from posttrain.cli import main
from posttrain.k8s.options import RenderError, RenderOptions
from posttrain.k8s.render import render

OUT = "s3://bucket/runs/sft"
IMAGE = "registry.example.com/team/posttrain:0.1.0"
REMOTE_MODEL, REMOTE_DATA = "s3://bucket/models/base", "s3://bucket/data/train.jsonl"


def _options(*overrides: str, **kw) -> RenderOptions:
    base = {"config": "sft_tiny", "nodes": 1, "gpus_per_node": 8, "output_dir": OUT, "image": IMAGE}
    return RenderOptions(**{**base, "overrides": overrides, **kw})


def _command(files) -> list[str]:
    return next(doc for doc in files["trainjob.yaml"] if doc["kind"] == "TrainJob")["spec"]["trainer"]["command"]


def test_a_local_model_directory_is_refused_naming_model_path(tmp_path):
    model = tmp_path / "base-model"
    model.mkdir()
    with pytest.raises(RenderError) as error:
        render(_options(f"model.path={model}", f"data.train={REMOTE_DATA}"))
    message = str(error.value)
    assert "\n" not in message
    assert f"model.path={model}" in message and "data.train" not in message
    assert "--allow-local-paths" in message and "s3://" in message  # the two fixes


def test_a_local_data_file_is_refused_naming_data_train(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n", encoding="utf-8")
    with pytest.raises(RenderError, match=r"data\.train=.*train\.jsonl") as error:
        render(_options(f"model.path={REMOTE_MODEL}", f"data.train={data}"))
    assert "model.path" not in str(error.value)
    # A path that does not exist here is no more reachable from a pod: a relative path with a file suffix.
    with pytest.raises(RenderError, match=r"data\.eval=data/held_out\.jsonl"):
        render(_options(f"model.path={REMOTE_MODEL}", f"data.train={REMOTE_DATA}", "data.eval=data/held_out.jsonl"))


def test_the_packaged_recipe_paths_are_each_named_on_one_line(capsys):
    """sft_tiny's own model.path and data.train (runs/demo/...) are local: the CLI stops with exit 2, one line."""
    code = main(["k8s", "render", "--config", "sft_tiny", "--nodes", "1", "--gpus-per-node", "8",
                 "--output-dir", OUT, "--image", IMAGE])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "model.path=runs/demo/base-model" in lines[0] and "data.train=runs/demo/data/sample_sft.jsonl" in lines[0]


def test_other_path_valued_keys_are_found_by_walking_the_config():
    """Not only model.path and data.train: a DPO reference model is a path too, found by its key's name."""
    with pytest.raises(RenderError, match=r"paths: dpo\.reference_model=runs/pref/reference\. ") as error:
        render(_options(f"model.path={REMOTE_MODEL}", f"data.train={REMOTE_DATA}", "data.eval=null",
                        "dpo.reference_model=runs/pref/reference", config="dpo_tiny"))
    assert "model.path" not in str(error.value)
    # Scratch space the run writes inside its own pod (the checkpoint mirror) is not a path to reach.
    assert render(_options(f"model.path={REMOTE_MODEL}", f"data.train={REMOTE_DATA}", "store.local_dir=/scratch/run"))


def test_allow_local_paths_keeps_them_with_a_warning(tmp_path, capsys):
    """For paths baked into the image: rendered as written, and the warning names each one."""
    files = render(_options(allow_local_paths=True))
    err = capsys.readouterr().err
    assert "--allow-local-paths" in err and "inside the image" in err
    assert "model.path=runs/demo/base-model" in err and "data.train=runs/demo/data/sample_sft.jsonl" in err
    assert "  path: runs/demo/base-model\n" in files["common.yaml"][0]["data"]["recipe.yaml"]
    # In-image absolute paths given as overrides travel in the command.
    command = _command(render(_options("model.path=/models/base", "data.train=/data/train.jsonl",
                                       allow_local_paths=True)))
    assert "model.path=/models/base" in command and "data.train=/data/train.jsonl" in command
    code = main(["k8s", "render", "--config", "sft_tiny", "--nodes", "1", "--gpus-per-node", "8",
                 "--output-dir", OUT, "--image", IMAGE, "--allow-local-paths", "--out", str(tmp_path)])
    assert code == 0 and "model.path=runs/demo/base-model" in capsys.readouterr().err


def test_urls_and_hub_ids_render_without_a_warning(capsys):
    files = render(_options("model.path=meta-llama/Llama-3.2-1B", f"data.train={REMOTE_DATA}",
                            "data.eval=gs://bucket/data/eval-*.parquet"))
    command = _command(files)
    assert "model.path=meta-llama/Llama-3.2-1B" in command and f"data.train={REMOTE_DATA}" in command
    assert render(_options(f"model.path={REMOTE_MODEL}", f"data.train={REMOTE_DATA}"))
    assert "local" not in capsys.readouterr().err


def test_the_image_is_required_and_the_message_says_how_to_make_one(capsys):
    with pytest.raises(RenderError, match="--image") as error:
        render(_options(f"model.path={REMOTE_MODEL}", f"data.train={REMOTE_DATA}", image=""))
    assert "Dockerfile" in str(error.value)
    code = main(["k8s", "render", "--config", "sft_tiny", "--nodes", "1", "--gpus-per-node", "8",
                 "--output-dir", OUT, f"model.path={REMOTE_MODEL}", f"data.train={REMOTE_DATA}"])
    err = capsys.readouterr().err
    assert code == 2 and "--image" in err and "Dockerfile" in err and "internal error" not in err
    files = render(_options(f"model.path={REMOTE_MODEL}", f"data.train={REMOTE_DATA}"))
    images = {c["image"] for doc in files["trainjob.yaml"] if doc["kind"] == "TrainingRuntime"
              for c in doc["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
                  "containers"]}
    assert images == {IMAGE}
