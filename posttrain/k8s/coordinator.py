"""The rendezvous coordinator: one small on-demand pod that holds torchrun's c10d store, and its Service.

Why a pod of its own rather than worker rank 0: torchrun's c10d rendezvous keeps its state (who is in the
round, which round it is) in a TCPStore, and by default the agent whose host name matches the endpoint
serves it. If that agent's node is a spot node and is reclaimed, the store and every other agent's
connection go with it, and the survivors cannot form the next round. Here the store runs in a Deployment on
on-demand nodes (``python -m posttrain.k8s.store``), every agent is a client (``--rdzv-conf is_host=false``),
and the Service name is the endpoint; losing any number of spot nodes never touches it. The process group
itself is bootstrapped from whichever agent is rank 0 of each round, so that role moves with the survivors.
The coordinator needs no GPU (a quarter of a core, 256 MiB); the Deployment recreates it if its node fails.
"""

from __future__ import annotations

from posttrain.k8s.options import RDZV_PORT, RenderOptions
from posttrain.k8s.pods import ON_DEMAND, labels, metadata, placement

ROLE = "rdzv"


def coordinator_name(job: str) -> str:
    return f"{job}-rdzv"


def rdzv_endpoint(job: str) -> str:
    return f"{coordinator_name(job)}:{RDZV_PORT}"


def coordinator_deployment(job: str, options: RenderOptions) -> dict:
    name = coordinator_name(job)
    pod_labels = labels(job, ROLE, ON_DEMAND)
    container = {
        "name": "store",
        "image": options.image,
        "command": ["python", "-m", "posttrain.k8s.store", "--port", str(RDZV_PORT)],
        "ports": [{"name": "rdzv", "containerPort": RDZV_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "rdzv"}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, options, pod_labels),
        "spec": {
            "replicas": 1,
            # Never two stores at once: agents split between two would form two different rounds.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {**placement(ON_DEMAND, options), "containers": [container]},
            },
        },
    }


def coordinator_service(job: str, options: RenderOptions) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(coordinator_name(job), options, labels(job, ROLE)),
        "spec": {
            "selector": labels(job, ROLE, ON_DEMAND),
            "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": "rdzv", "protocol": "TCP"}],
        },
    }
