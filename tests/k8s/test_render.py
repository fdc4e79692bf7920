"""`posttrain k8s render`: every configuration validates against the pinned schemas, lints clean, and means
what the docs say (placement, restarts on exit 75, grace period, secrets, metrics port, shm, GPUs)."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main
from posttrain.k8s.options import SPOT_PRESETS, RenderError, RenderOptions, parse_spot_selector
from posttrain.k8s.render import render, to_yaml
from tests.k8s.manifests import lint_errors, load_documents, schema_errors

OUT = "s3://bucket/runs/sft"
IMAGE = "registry.example.com/team/posttrain:0.1.0"
# sft_tiny's own model.path and data.train are local (runs/demo/...): the pods get URLs instead.
REMOTE_INPUTS = ("model.path=s3://bucket/models/base", "data.train=s3://bucket/data/train.jsonl")
KARPENTER = "karpenter.sh/capacity-type"
GKE = "cloud.google.com/gke-spot"


def _cli(*flags: str) -> list[str]:
    """A CLI render with ``flags``; the overrides go last, next to any in ``flags`` (argparse takes one run)."""
    return ["k8s", "render", "--config", "sft_tiny", "--nodes", "2", "--gpus-per-node", "8", "--image", IMAGE,
            *flags, *REMOTE_INPUTS]


def _options(**kw) -> RenderOptions:
    base = {"config": "sft_tiny", "nodes": 2, "gpus_per_node": 8, "output_dir": OUT, "kind": "both", "image": IMAGE}
    overrides = (*REMOTE_INPUTS, *kw.pop("overrides", ()))
    return RenderOptions(**{**base, **kw, "overrides": overrides})


def _pod_specs(files) -> list[tuple[str, dict, dict]]:
    """(kind of the owner, pod template metadata, pod spec) of every worker pod template."""
    out = []
    for doc in files.get("trainjob.yaml", []):
        if doc["kind"] != "TrainJob":
            template = doc["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
            out.append((doc["kind"], template["metadata"], template["spec"]))
    for doc in files.get("pytorchjob.yaml", []):
        template = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        out.append((doc["kind"], template["metadata"], template["spec"]))
    return out


def _requires(spec: dict) -> list[list[dict]]:
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return [term["matchExpressions"] for term in terms]


def _on_demand_only(spec: dict, label: str = KARPENTER, value: str = "spot") -> bool:
    terms = _requires(spec)
    return len(terms) == 1 and {"key": label, "operator": "NotIn", "values": [value]} in terms[0] and not any(
        t.get("value") == value for t in spec.get("tolerations", []))


CONFIGS = [(n, k) for n in range(1, 5) for k in range(0, n + 1)]


@pytest.mark.parametrize(("nodes", "spot"), CONFIGS)
def test_every_document_validates_and_lints_and_nodes_add_up(nodes, spot):
    files = render(_options(nodes=nodes, spot_workers=spot, gpus_per_node=4))
    for name, documents in files.items():
        text = to_yaml(documents)
        assert lint_errors(text, name) == []
        reread = load_documents(text)
        assert reread == documents  # the YAML says exactly what was built
        for document in reread:
            assert schema_errors(document) == []
    jobs = [d for d in files["trainjob.yaml"] if d["kind"] == "TrainJob"]
    assert sum(j["spec"]["trainer"]["numNodes"] for j in jobs) == nodes
    by_capacity = {d["metadata"]["labels"]["posttrain.io/capacity"]: d for d in files["pytorchjob.yaml"]}
    counts = {cap: d["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] for cap, d in by_capacity.items()}
    assert counts == {cap: n for cap, n in (("on-demand", nodes - spot), ("spot", spot)) if n}
    for kind, meta, spec in _pod_specs(files):
        container = spec["containers"][0]
        if meta["labels"]["posttrain.io/capacity"] == "spot":
            assert {"key": KARPENTER, "operator": "Equal", "value": "spot", "effect": "NoSchedule"} in spec[
                "tolerations"]
            assert _requires(spec) == [[{"key": KARPENTER, "operator": "In", "values": ["spot"]}]]
        else:
            assert _on_demand_only(spec), (kind, spec)
        # GPUs: G per node, requested and limited (TrainJob: resourcesPerNode; PyTorchJob: the container)
        if kind == "PyTorchJob":
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
            assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    for job in jobs:
        assert job["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "4"
        assert job["spec"]["trainer"]["numProcPerNode"] == 4
        command = job["spec"]["trainer"]["command"]
        assert command[command.index("--nnodes") + 1] == f"{max(1, nodes - spot)}:{nodes}"


def test_the_coordinator_never_runs_on_spot_and_every_agent_is_its_client():
    files = render(_options(nodes=4, spot_workers=4))
    service, deployment = files["common.yaml"][1], files["common.yaml"][2]
    pod = deployment["spec"]["template"]
    assert _on_demand_only(pod["spec"]) and "tolerations" not in pod["spec"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == 29400
    endpoint = f"{service['metadata']['name']}:29400"
    for job in files["trainjob.yaml"][1::2]:
        command = job["spec"]["trainer"]["command"]
        assert command[:2] == ["posttrain", "launch"]
        assert command[command.index("--rdzv-endpoint") + 1] == endpoint
        assert command[command.index("--rdzv-backend") + 1] == "c10d"
        assert command[command.index("--rdzv-conf") + 1] == "is_host=false"
        assert command[command.index("--") + 1:command.index("--") + 4] == ["sft", "--config",
                                                                            "/etc/posttrain/recipe.yaml"]
    for job in files["pytorchjob.yaml"]:
        elastic = job["spec"]["elasticPolicy"]
        assert (elastic["rdzvBackend"], f"{elastic['rdzvHost']}:{elastic['rdzvPort']}") == ("c10d", endpoint)


def test_exit_75_restarts_without_counting_a_failure_in_both_kinds():
    files = render(_options(nodes=3, spot_workers=2))
    for doc in files["trainjob.yaml"][::2]:
        job = doc["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
        rules = job["podFailurePolicy"]["rules"]
        assert {"action": "Ignore", "onExitCodes": {"containerName": "node", "operator": "In", "values": [75]}} in rules
        assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
        assert job["template"]["spec"]["restartPolicy"] == "Never"  # required by podFailurePolicy
        assert job["template"]["spec"]["containers"][0]["name"] == "node"
    for doc in files["pytorchjob.yaml"]:
        worker = doc["spec"]["pytorchReplicaSpecs"]["Worker"]
        assert worker["restartPolicy"] == "ExitCode"
        # the operator retries only codes >= 128: the wrapper maps 75 to 138 (tests/k8s/test_processes.py)
        assert worker["template"]["spec"]["containers"][0]["command"][:4] == [
            "python", "-m", "posttrain.k8s.retryable", "--"]


def test_grace_period_covers_the_measured_checkpoint_time(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 10, "loss": 1.0}, {"step": 10, "checkpoint_save_s": 12.5},
             {"step": 20, "checkpoint_save_s": 200.2}, {"step": 30, "checkpoint_save_s": 150.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 4', encoding="utf-8")
    files = render(_options(from_run=str(run)))
    # 2 × 200.2 + 60 = 460.4 → 461 s, above the default 300
    assert {spec["terminationGracePeriodSeconds"] for _, _, spec in _pod_specs(files)} == {461}
    (run / "metrics.jsonl").write_text(json.dumps({"checkpoint_save_s": 30.0}) + "\n", encoding="utf-8")
    # 2 × 30 + 60 = 120 < 300: the default stands
    assert {spec["terminationGracePeriodSeconds"] for _, _, spec in _pod_specs(render(_options(from_run=str(run))))} \
        == {300}
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n", encoding="utf-8")
    files = render(_options(from_run=str(run), grace_period_s=90))
    assert {spec["terminationGracePeriodSeconds"] for _, _, spec in _pod_specs(files)} == {90}


def test_s3_secret_shm_metrics_port_and_output_dir():
    files = render(_options(s3_secret="my-s3", metrics_port=9500, shm_size="32Gi"))
    monitor = files["podmonitor.yaml"][0]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    for _kind, meta, spec in _pod_specs(files):
        container = spec["containers"][0]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
        assert refs["AWS_ACCESS_KEY_ID"] == {"name": "my-s3", "key": "AWS_ACCESS_KEY_ID"}
        assert refs["AWS_SECRET_ACCESS_KEY"] == {"name": "my-s3", "key": "AWS_SECRET_ACCESS_KEY"}
        assert refs["AWS_ENDPOINT_URL"]["optional"] is True
        assert {"name": "metrics", "containerPort": 9500, "protocol": "TCP"} in container["ports"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= meta["labels"].items()
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    command = files["trainjob.yaml"][1]["spec"]["trainer"]["command"]
    assert f"output_dir={OUT}" in command
    no_secret = render(_options(s3_secret=""))
    assert all("valueFrom" not in e for _, _, spec in _pod_specs(no_secret) for e in spec["containers"][0]["env"])


def test_a_signing_secret_reaches_every_pod_and_the_command_names_its_variable():
    files = render(_options(signing_secret="run-signing"))
    for _kind, _meta, spec in _pod_specs(files):
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in spec["containers"][0]["env"] if "valueFrom" in e}
        assert refs["POSTTRAIN_SIGNING_KEY"] == {"name": "run-signing", "key": "signing-key"}
    command = files["trainjob.yaml"][1]["spec"]["trainer"]["command"]
    assert "store.signing_key=env:POSTTRAIN_SIGNING_KEY" in command
    assert not [e for docs in files.values() for doc in docs for e in schema_errors(doc)]
    # A recipe that signs with a key the pods would not get is refused before anything is written.
    with pytest.raises(RenderError, match="--signing-secret NAME"):
        render(_options(overrides=("store.signing_key=env:MY_KEY",)))
    # Without either, nothing about signing is rendered.
    plain = render(_options())
    assert all(e["name"] != "POSTTRAIN_SIGNING_KEY" for _, _, spec in _pod_specs(plain) for e in spec["containers"][0]["env"])


def test_metrics_port_override_is_passed_when_the_recipe_knows_it():
    from posttrain.config.keys import config_keys
    from posttrain.config.registry import RECIPES, load_builtin_recipes

    load_builtin_recipes()
    knows = any(k.key == "metrics.prometheus_port" for k in config_keys(RECIPES["sft"].schema))
    command = render(_options(metrics_port=9500))["trainjob.yaml"][1]["spec"]["trainer"]["command"]
    assert ("metrics.prometheus_port=9500" in command) == knows


def test_gke_and_custom_spot_selectors_combine():
    selectors = (parse_spot_selector("gke"), parse_spot_selector("custom=example.com/lifecycle=spot"))
    files = render(_options(nodes=2, spot_workers=1, spot_selectors=selectors, kind="trainjob"))
    specs = {meta["labels"]["posttrain.io/capacity"]: spec for _, meta, spec in _pod_specs(files)}
    assert _requires(specs["spot"]) == [[{"key": GKE, "operator": "In", "values": ["true"]}],
                                         [{"key": "example.com/lifecycle", "operator": "In", "values": ["spot"]}]]
    assert {t["key"] for t in specs["spot"]["tolerations"]} == {GKE, "example.com/lifecycle"}
    assert _requires(specs["on-demand"]) == [[{"key": GKE, "operator": "NotIn", "values": ["true"]},
                                              {"key": "example.com/lifecycle", "operator": "NotIn",
                                               "values": ["spot"]}]]
    assert "pytorchjob.yaml" not in files
    with pytest.raises(RenderError, match="custom=KEY=VALUE"):
        parse_spot_selector("aws")
    assert parse_spot_selector("karpenter") == SPOT_PRESETS["karpenter"]


def test_a_recipe_file_travels_in_the_config_map(tmp_path):
    recipe = tmp_path / "mine.yaml"
    text = "# my edited recipe\nrecipe: sft\noutput_dir: s3://b/mine\nmodel:\n  path: s3://b/base\n" \
           "data:\n  train: s3://b/train.jsonl\n"
    recipe.write_text(text, encoding="utf-8")
    files = render(RenderOptions(config=str(recipe), nodes=1, gpus_per_node=1, name="mine", image=IMAGE))
    config_map = files["common.yaml"][0]
    assert config_map["data"]["recipe.yaml"] == text
    assert config_map["metadata"]["name"] == "mine-recipe"
    assert files["trainjob.yaml"][0]["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]["volumes"][1] == {"name": "recipe", "configMap": {"name": "mine-recipe"}}


@pytest.mark.parametrize(("flags", "message"), [
    (["--output-dir", "runs/local"], "local path"),
    (["--output-dir", OUT, "--spot-workers", "3"], "--spot-workers 3"),
    (["--output-dir", OUT, "--name", "Bad_Name"], "--name"),
    (["--output-dir", OUT, "--spot-selector", "aws"], "custom=KEY=VALUE"),
    (["--output-dir", OUT, "train.lerning_rate=1"], "unknown key"),
    (["--output-dir", OUT, "--min-nodes", "5"], "--min-nodes 5"),
])
def test_bad_flags_exit_2_with_the_fix(flags, message, capsys):
    code = main(_cli(*flags))
    assert code == 2
    assert message in capsys.readouterr().err


def test_stdout_stream_and_out_dir_hold_the_same_documents(tmp_path, capsys):
    args = _cli("--output-dir", OUT, "--spot-workers", "1")
    assert main(args) == 0
    streamed = load_documents(capsys.readouterr().out)
    (tmp_path / "pytorchjob.yaml").write_text("stale from an earlier --kind both\n", encoding="utf-8")
    assert main([*args, "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["common.yaml", "podmonitor.yaml", "trainjob.yaml"]  # the stale pytorchjob.yaml is gone
    written = [d for n in ("common.yaml", "trainjob.yaml", "podmonitor.yaml")
               for d in load_documents((tmp_path / n).read_text(encoding="utf-8"))]
    assert written == streamed
    assert [d["kind"] for d in streamed] == ["ConfigMap", "Service", "Deployment", "TrainingRuntime", "TrainJob",
                                             "TrainingRuntime", "TrainJob", "PodMonitor"]


def test_cluster_training_runtime_is_referenced_by_kind():
    files = render(_options(runtime_kind="ClusterTrainingRuntime", kind="trainjob", namespace="ml"))
    runtime, job = files["trainjob.yaml"][:2]
    assert runtime["kind"] == "ClusterTrainingRuntime" and schema_errors(runtime) == []
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": runtime["metadata"]["name"]}
    assert job["metadata"]["namespace"] == "ml"
    assert "namespace" not in runtime["metadata"]  # cluster-scoped


def _plan(tmp_path, *flags: str, model: str = "llama3-8b"):
    path = tmp_path / f"plan-{len(list(tmp_path.glob('plan-*')))}.json"
    assert main(["plan", "--model", model, *flags, "--json", str(path)]) == 0
    return path


def test_a_plan_is_checked_against_the_shape_and_quoted_in_every_object(tmp_path, capsys):
    plan = _plan(tmp_path, "--gpus", "16", "--gpus-per-node", "8")
    capsys.readouterr()
    files = render(_options(plan=str(plan)))
    saved = json.loads(plan.read_text())
    docs = [doc for documents in files.values() for doc in documents]
    quoted = {doc["metadata"]["annotations"]["posttrain.dev/plan"] for doc in docs}
    assert len(quoted) == 1
    summary = json.loads(quoted.pop())
    assert summary["gpus"] == 16 and summary["model"] == "llama3-8b"
    assert summary["peak_gib_per_gpu"] == round(saved["memory_bytes"]["peak_per_gpu"] / 2**30, 1)
    assert summary["checkpoint_interval_min"] == round(saved["run"]["checkpoint_interval_s"] / 60, 1)
    assert not [e for doc in docs for e in schema_errors(doc)]  # annotations keep every document valid

    wrong = _plan(tmp_path, "--gpus", "32", "--gpus-per-node", "8")
    with pytest.raises(RenderError, match="is for 32 GPUs"):
        render(_options(plan=str(wrong)))


def test_a_plan_that_offloads_more_than_the_memory_request_is_refused(tmp_path, capsys):
    plan = _plan(tmp_path, "--gpus", "16", "--gpus-per-node", "8", "--offload", "optimizer", model="llama3-70b")
    host = json.loads(plan.read_text())["memory_bytes"]["host_per_node"]
    assert host > 64 * 2**30  # the example is built so that the default 64Gi cannot hold it
    code = main(_cli("--output-dir", OUT, "--plan", str(plan)))
    assert code == 2 and "raise --memory" in capsys.readouterr().err
    enough = f"{int(host / 2**30) + 8}Gi"
    assert render(_options(plan=str(plan), memory=enough))
