"""Kubeflow Trainer v2: a ``TrainJob`` (trainer.kubeflow.org/v1alpha1) per worker group, each with its runtime.

Trainer's torch runtime has one replicated job, ``node``, whose pods are all alike, so the on-demand and the
spot workers are two TrainJobs (and two runtimes: their pods differ only in placement). Both run the same
``posttrain launch`` command against the same rendezvous (coordinator Service, same ``--rdzv-id``), so
torchrun sees one elastic run of all their nodes.

Restarts, innermost first:
1. torchrun restarts its workers in place after a worker failure (``--max-restarts``) and re-forms the
   round when a node leaves or joins (no restart counted).
2. A pod that ends with exit 75 (preempted or stalled, after saving a checkpoint) or that is evicted from a
   reclaimed spot node (``DisruptionTarget``) is replaced by the Job without counting a failure
   (``podFailurePolicy`` action ``Ignore``); exit 2 (bad config or input: a restart cannot fix it) fails
   the Job at once; any other failure counts against ``backoffLimit``.
3. The JobSet recreates its Jobs when one fails (``failurePolicy.maxRestarts``), except after exit 2.
"""

from __future__ import annotations

from posttrain.exit_codes import EXIT_BAD_CONFIG, EXIT_RESUMABLE
from posttrain.k8s.options import RenderOptions
from posttrain.k8s.pods import (
    Group,
    labels,
    metadata,
    ports,
    resources,
    volume_mounts,
    worker_env,
    worker_pod_spec,
)

API = "trainer.kubeflow.org/v1alpha1"
CONTAINER = "node"  # Trainer's torch plugin injects its PET_* settings into the container of this name


def pod_failure_policy(container: str) -> dict:
    """Job-level rules (batch/v1 podFailurePolicy), evaluated in order; the first match decides."""
    return {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Ignore", "onExitCodes": {"containerName": container, "operator": "In",
                                             "values": [EXIT_RESUMABLE]}},
        {"action": "FailJob", "onExitCodes": {"containerName": container, "operator": "In",
                                              "values": [EXIT_BAD_CONFIG]}},
    ]}


def runtime(name: str, job: str, group: Group, options: RenderOptions, recipe_config_map: str,
            grace_period_s: int) -> dict:
    pod_labels = labels(job, "worker", group.capacity)
    container = {"name": CONTAINER, "image": options.image, "env": worker_env(options), "ports": ports(options),
                 "volumeMounts": volume_mounts()}
    runtime_metadata = metadata(name, options, {**pod_labels, "trainer.kubeflow.org/framework": "torch"})
    if options.runtime_kind == "ClusterTrainingRuntime":
        runtime_metadata.pop("namespace", None)  # cluster-scoped
    return {
        "apiVersion": API,
        "kind": options.runtime_kind,
        "metadata": runtime_metadata,
        "spec": {
            "mlPolicy": {"numNodes": group.nodes, "torch": {}},
            "template": {"spec": {
                "failurePolicy": {
                    "maxRestarts": options.max_restarts,
                    "rules": [{"name": "badConfig", "action": "FailJobSet",
                               "onJobFailureReasons": ["PodFailurePolicy"]}],
                },
                "replicatedJobs": [{
                    "name": "node",
                    "template": {
                        "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                        "spec": {
                            "backoffLimit": options.backoff_limit,
                            "podFailurePolicy": pod_failure_policy(CONTAINER),
                            "template": {
                                "metadata": {"labels": pod_labels},
                                # podFailurePolicy requires restartPolicy Never: the Job, not the kubelet, restarts.
                                "spec": worker_pod_spec(group.capacity, options, recipe_config_map, grace_period_s,
                                                        container, restart_policy="Never"),
                            },
                        },
                    },
                }],
            }},
        },
    }


def train_job(name: str, job: str, group: Group, options: RenderOptions, command: list[str]) -> dict:
    return {
        "apiVersion": API,
        "kind": "TrainJob",
        "metadata": metadata(name, options, labels(job, "worker", group.capacity)),
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": options.runtime_kind, "name": name},
            "trainer": {
                "image": options.image,
                "command": command,
                "numNodes": group.nodes,
                "numProcPerNode": options.gpus_per_node,
                "resourcesPerNode": resources(options),
            },
        },
    }
