"""The files under deploy/ and the Dockerfile: the example manifests are what the command renders today, every
YAML file lints clean and every manifest in it validates, the vendored schemas are sound and can reject."""

from __future__ import annotations

import copy
import json
import re

import pytest

from posttrain.cli import build_parser, main
from tests.k8s.manifests import REPO, SCHEMA_DIR, lint_errors, load_documents, schema_errors, schemas, strict

EXAMPLE_DIR = REPO / "deploy" / "k8s" / "examples" / "sft_tiny"
EXAMPLE_ARGS = ["k8s", "render", "--config", "sft_tiny", "--nodes", "2", "--gpus-per-node", "8", "--spot-workers",
                "1", "--kind", "both", "--output-dir", "s3://posttrain-runs/sft-tiny",
                "--image", "ghcr.io/your-org/posttrain:0.1.0",
                "model.path=s3://posttrain-runs/models/base", "data.train=s3://posttrain-runs/data/sample_sft.jsonl"]
REGENERATE = f"posttrain {' '.join(EXAMPLE_ARGS)} --out deploy/k8s/examples/sft_tiny"


def test_the_examples_are_what_the_command_renders(tmp_path):
    assert main([*EXAMPLE_ARGS, "--out", str(tmp_path)]) == 0
    rendered = {p.name: p.read_text(encoding="utf-8") for p in sorted(tmp_path.iterdir())}
    committed = {p.name: p.read_text(encoding="utf-8") for p in sorted(EXAMPLE_DIR.glob("*.yaml"))}
    assert rendered.keys() == committed.keys(), f"regenerate with: {REGENERATE}"
    for name in rendered:
        assert rendered[name] == committed[name], f"{name} is stale; regenerate with: {REGENERATE}"


def _deploy_yaml():
    return sorted(p for p in (REPO / "deploy").rglob("*") if p.suffix in (".yaml", ".yml"))


def test_every_yaml_file_under_deploy_lints_clean():
    files = _deploy_yaml()
    assert EXAMPLE_DIR / "trainjob.yaml" in files
    problems = [e for path in files for e in lint_errors(path.read_text(encoding="utf-8"), str(path))]
    assert problems == []


def test_every_manifest_under_deploy_validates():
    checked = 0
    for path in _deploy_yaml():
        for document in load_documents(path.read_text(encoding="utf-8")):
            if isinstance(document, dict) and "apiVersion" in document and "kind" in document:
                assert schema_errors(document) == [], path
                checked += 1
    assert checked >= 10


def test_the_vendored_schemas_are_valid_small_and_recorded():
    from jsonschema import Draft7Validator

    files = sorted(SCHEMA_DIR.glob("*.json"))
    assert sum(p.stat().st_size for p in files) < 3_000_000
    readme = (SCHEMA_DIR / "README.md").read_text(encoding="utf-8")
    for path in files:
        Draft7Validator.check_schema(strict(json.loads(path.read_text(encoding="utf-8"))))
        assert path.name in readme, f"{path.name} is not recorded in deploy/schemas/README.md"
    assert len(re.findall(r"\b[0-9a-f]{40}\b", readme)) >= 4  # each source pinned to a commit
    assert {("trainer.kubeflow.org/v1alpha1", "TrainJob"), ("kubeflow.org/v1", "PyTorchJob"),
            ("monitoring.coreos.com/v1", "PrometheusRule"), ("apps/v1", "Deployment")} <= set(schemas())


def _example(kind: str) -> dict:
    documents = [d for p in sorted(EXAMPLE_DIR.glob("*.yaml")) for d in load_documents(p.read_text(encoding="utf-8"))]
    return copy.deepcopy(next(d for d in documents if d["kind"] == kind))


def _break_grace_period(doc):
    pod = doc["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")


def _break_gpu_count(doc):
    doc["spec"]["trainer"]["numNodes"] = "1"


def _break_restart_rule(doc):
    del doc["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][1][
        "action"]


def _break_elastic(doc):
    doc["spec"]["elasticPolicy"]["minReplica"] = 1


def _break_deployment(doc):
    doc["spec"]["replicas"] = "one"


def _break_service_port(doc):
    doc["spec"]["ports"][0]["port"] = {"number": 29400}


def _break_podmonitor(doc):
    del doc["spec"]["selector"]


def _break_kind(doc):
    doc["apiVersion"] = "kubeflow.org/v2"


@pytest.mark.parametrize(("kind", "breaker", "message"), [
    ("TrainingRuntime", _break_grace_period, "'terminationGracePeriodSecond' was unexpected"),
    ("TrainJob", _break_gpu_count, "is not of type 'integer'"),
    ("TrainingRuntime", _break_restart_rule, "'action' is a required property"),
    ("PyTorchJob", _break_elastic, "'minReplica' was unexpected"),
    ("Deployment", _break_deployment, "is not of type 'integer'"),
    ("Service", _break_service_port, "is not of type 'integer'"),
    ("PodMonitor", _break_podmonitor, "'selector' is a required property"),
    ("PyTorchJob", _break_kind, "no vendored schema"),
])
def test_a_broken_manifest_fails_validation(kind, breaker, message):
    document = _example(kind)
    assert schema_errors(document) == []
    breaker(document)
    errors = schema_errors(document)
    assert any(message in e for e in errors), errors


def test_a_prometheus_rule_validates_with_its_go_patterns():
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "r"},
            "spec": {"groups": [{"name": "g", "partial_response_strategy": "WARN",
                                 "rules": [{"alert": "A", "expr": "up == 0", "for": "5m"}]}]}}
    assert schema_errors(rule) == []
    rule["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    assert any("does not match" in e for e in schema_errors(rule))


def test_lint_catches_bad_yaml():
    assert lint_errors("---\nkey: value\nkey: other\n")  # duplicate key
    assert lint_errors("---\nlist:\n- a\n")  # sequence not indented


def test_dockerfile_pins_its_base_image_and_torch():
    text = (REPO / "Dockerfile").read_text(encoding="utf-8")
    bases = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert bases, "no FROM line"
    for base in bases:
        name, _, tag = base.partition(":")
        assert tag and tag != "latest" and "$" not in base, base
    assert re.search(r"^FROM nvidia/cuda:\d+\.\d+\.\d+-cudnn-runtime-ubuntu\d\d\.04$", text, flags=re.M)
    assert "latest" not in text.replace("never use :latest", "")
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, flags=re.M)
    version = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(encoding="utf-8"), flags=re.M)
    assert f"ARG TORCH_VERSION={version.group(1)}" in text  # the image trains with the torch the tests use
    assert '".[s3,prometheus,nvml]"' in text and "-c constraints.txt" in text


def _render_parser():
    k8s = build_parser()._subparsers._group_actions[0].choices["k8s"]
    return k8s._subparsers._group_actions[0].choices["render"]


def test_render_help_describes_every_flag():
    parser = _render_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        assert action.help and len(action.help) > 15, action.option_strings or action.dest
        for option in action.option_strings:
            assert option in text
        assert " ".join(action.help.split())[:30] in text
    for flag in ("--nodes", "--gpus-per-node", "--spot-workers", "--spot-selector", "--kind", "--grace-period-s",
                 "--from-run", "--s3-secret", "--signing-secret", "--output-dir", "--image", "--allow-local-paths",
                 "--cpu", "--memory", "--out"):
        assert flag in text
