"""Kubeflow training operator (v1): a ``PyTorchJob`` (kubeflow.org/v1) with ``elasticPolicy``, per worker group.

For clusters that still run the old operator. As with TrainJob, the on-demand and spot workers are two jobs
of ``Worker`` replicas joining one rendezvous (the operator allows a single ``Master`` replica, which cannot
hold N−K on-demand nodes). ``elasticPolicy`` names the same c10d endpoint the command passes to torchrun; its
``minReplicas``/``maxReplicas`` bound this group, while torchrun's ``--nnodes MIN:MAX`` bounds the whole run.

``restartPolicy: ExitCode`` restarts a replica only for exit codes ≥ 128, so the container runs under
``posttrain.k8s.retryable``, which turns exit 75 into 138 (see that module); 1 and 2 stay permanent.
"""

from __future__ import annotations

from posttrain.k8s.coordinator import coordinator_name
from posttrain.k8s.options import RDZV_PORT, RenderOptions
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

CONTAINER = "pytorch"  # the operator finds the training container by this name


def pytorch_job(name: str, job: str, group: Group, options: RenderOptions, recipe_config_map: str,
                grace_period_s: int, command: list[str]) -> dict:
    pod_labels = labels(job, "worker", group.capacity)
    container = {"name": CONTAINER, "image": options.image,
                 "command": ["python", "-m", "posttrain.k8s.retryable", "--", *command],
                 "env": worker_env(options), "ports": ports(options), "resources": resources(options),
                 "volumeMounts": volume_mounts()}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata(name, options, pod_labels),
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "rdzvHost": coordinator_name(job),
                "rdzvPort": RDZV_PORT,
                "rdzvId": job,
                "minReplicas": 1,
                "maxReplicas": group.nodes,
                "nProcPerNode": options.gpus_per_node,
                "maxRestarts": options.max_restarts,
            },
            "runPolicy": {"backoffLimit": options.backoff_limit, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": group.nodes,
                    "restartPolicy": "ExitCode",
                    "template": {
                        "metadata": {"labels": pod_labels},
                        "spec": worker_pod_spec(group.capacity, options, recipe_config_map, grace_period_s,
                                                container),
                    },
                },
            },
        },
    }
