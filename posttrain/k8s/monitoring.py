"""A prometheus-operator ``PodMonitor`` (monitoring.coreos.com/v1) that scrapes every training pod's
``/metrics`` on the port named ``metrics`` (``metrics.prometheus_port`` in the recipe, set by the command)."""

from __future__ import annotations

from posttrain.k8s.options import RenderOptions
from posttrain.k8s.pods import LABEL_ROLE, labels, metadata


def pod_monitor(job: str, options: RenderOptions) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": metadata(job, options, labels(job, "monitor")),
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/instance": job, LABEL_ROLE: "worker"}},
            "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "30s"}],
        },
    }
