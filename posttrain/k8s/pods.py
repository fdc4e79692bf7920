"""The pod-level pieces every training pod shares, whichever job kind wraps it (plain dicts, no I/O).

Placement: a pod for spot capacity *requires* a node that carries one of the spot labels and tolerates the
matching taints; every other pod (on-demand workers and the rendezvous coordinator) requires a node that
carries none of them (``NotIn`` also matches nodes without the label, e.g. an on-demand node group that
Karpenter does not manage).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.k8s.options import CapacitySelector, RenderOptions, plan_annotations

SPOT, ON_DEMAND = "spot", "on-demand"
RECIPE_DIR = "/etc/posttrain"
RECIPE_FILE = f"{RECIPE_DIR}/recipe.yaml"
LABEL_ROLE = "posttrain.io/role"
LABEL_CAPACITY = "posttrain.io/capacity"


@dataclass(frozen=True)
class Group:
    """A set of identical worker nodes: all spot or all on-demand."""

    capacity: str  # SPOT or ON_DEMAND
    nodes: int

    @property
    def suffix(self) -> str:
        return "spot" if self.capacity == SPOT else "ondemand"


def worker_groups(options: RenderOptions) -> list[Group]:
    """The non-empty groups, on-demand first (they carry the run when every spot node is gone)."""
    groups = [Group(ON_DEMAND, options.on_demand_workers), Group(SPOT, options.spot_workers)]
    return [group for group in groups if group.nodes > 0]


def labels(name: str, role: str, capacity: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "posttrain", "app.kubernetes.io/instance": name, LABEL_ROLE: role}
    if capacity is not None:
        out[LABEL_CAPACITY] = capacity
    return out


def metadata(name: str, options: RenderOptions, object_labels: dict[str, str]) -> dict:
    out: dict = {"name": name}
    if options.namespace:
        out["namespace"] = options.namespace
    out["labels"] = dict(object_labels)
    if options.plan:  # every object of the run quotes the plan it was sized by (`posttrain plan --json`)
        out["annotations"] = dict(plan_annotations(options))
    return out


def node_affinity(capacity: str, selectors: tuple[CapacitySelector, ...]) -> dict:
    """Required node affinity: spot = any one spot label (terms are ORed); on-demand = none of them (ANDed)."""
    if capacity == SPOT:
        terms = [{"matchExpressions": [{"key": s.label, "operator": "In", "values": [s.value]}]} for s in selectors]
    else:
        terms = [{"matchExpressions": [{"key": s.label, "operator": "NotIn", "values": [s.value]}
                                       for s in selectors]}]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


def tolerations(capacity: str, selectors: tuple[CapacitySelector, ...]) -> list[dict]:
    if capacity != SPOT:
        return []
    return [{"key": s.label, "operator": "Equal", "value": s.value, "effect": s.taint_effect} for s in selectors]


def placement(capacity: str, options: RenderOptions) -> dict:
    """The pod-spec keys that put a pod on ``capacity`` nodes."""
    out: dict = {}
    if options.spot_selectors:
        out["affinity"] = node_affinity(capacity, options.spot_selectors)
    spot_tolerations = tolerations(capacity, options.spot_selectors)
    if spot_tolerations:
        out["tolerations"] = spot_tolerations
    return out


def s3_env(secret: str) -> list[dict]:
    """S3 credentials from a Secret; the endpoint (MinIO, R2, …) and region are optional keys of it."""
    if not secret:
        return []  # workload identity (IRSA, GKE WI) or a node role supplies the credentials

    def ref(key: str, optional: bool = False) -> dict:
        selector: dict = {"name": secret, "key": key}
        if optional:
            selector["optional"] = True
        return {"name": key, "valueFrom": {"secretKeyRef": selector}}

    return [ref("AWS_ACCESS_KEY_ID"), ref("AWS_SECRET_ACCESS_KEY"), ref("AWS_ENDPOINT_URL", optional=True),
            ref("AWS_DEFAULT_REGION", optional=True)]


SIGNING_KEY_ENV = "POSTTRAIN_SIGNING_KEY"  # store.signing_key=env:POSTTRAIN_SIGNING_KEY in the pods' command
SIGNING_SECRET_KEY = "signing-key"


def signing_env(secret: str) -> list[dict]:
    """The manifest-signing key from a Secret (``--signing-secret``), as the variable the command names."""
    if not secret:
        return []
    return [{"name": SIGNING_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": SIGNING_SECRET_KEY}}}]


def worker_env(options: RenderOptions) -> list[dict]:
    return [{"name": "PYTHONUNBUFFERED", "value": "1"}, *s3_env(options.s3_secret), *signing_env(options.signing_secret)]


def resources(options: RenderOptions) -> dict:
    """GPUs and memory are limited as requested; CPU is only requested: a CPU limit throttles the data loader
    and NCCL's progress threads (CFS quota) without protecting anyone a request does not already protect."""
    gpus = str(options.gpus_per_node)
    return {"requests": {"cpu": options.cpu, "memory": options.memory, "nvidia.com/gpu": gpus},
            "limits": {"memory": options.memory, "nvidia.com/gpu": gpus}}


def volumes(recipe_config_map: str, options: RenderOptions) -> list[dict]:
    # NCCL and the data loader's workers pass tensors through /dev/shm; a container's default is 64 MiB.
    return [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": options.shm_size}},
            {"name": "recipe", "configMap": {"name": recipe_config_map}}]


def volume_mounts() -> list[dict]:
    return [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "recipe", "mountPath": RECIPE_DIR, "readOnly": True}]


def ports(options: RenderOptions) -> list[dict]:
    return [{"name": "metrics", "containerPort": options.metrics_port, "protocol": "TCP"}]


def worker_pod_spec(capacity: str, options: RenderOptions, recipe_config_map: str, grace_period_s: int,
                    container: dict, restart_policy: str | None = None) -> dict:
    spec: dict = {}
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    spec["terminationGracePeriodSeconds"] = grace_period_s
    spec.update(placement(capacity, options))
    spec["containers"] = [container]
    spec["volumes"] = volumes(recipe_config_map, options)
    return spec
