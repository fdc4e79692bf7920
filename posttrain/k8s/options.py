"""What ``posttrain k8s render`` is asked to render, checked before anything is built.

``RenderOptions`` holds the flags; ``check_options`` rejects impossible combinations with the fix in the
message (``RenderError``, exit 2). Spot capacity is described by ``CapacitySelector``s: the node label that
marks a spot node and the taint such nodes may carry. The measured checkpoint time of an earlier run sets
the grace period (``grace_period_from_run``).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from posttrain import __version__

RDZV_PORT = 29400
DEFAULT_METRICS_PORT = 9400
DEFAULT_GRACE_PERIOD_S = 300
# No default image: posttrain publishes none, and a run must pull the image its user built from the Dockerfile.
IMAGE_HINT = (f"build the Dockerfile and push it where the cluster pulls from, e.g. docker build -t "
              f"REGISTRY/posttrain:{__version__} . && docker push REGISTRY/posttrain:{__version__} "
              "(docs/kubernetes.md, \"The image\")")
KINDS = ("trainjob", "pytorchjob", "both")
RUNTIME_KINDS = ("TrainingRuntime", "ClusterTrainingRuntime")
# Objects get suffixes (-ondemand, -spot, -rdzv, -recipe) and JobSet adds its own to pod names; 40 leaves room
# under the 63-character label limit.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")


class RenderError(ValueError):
    """The flags ask for something that cannot be rendered; the message says what to change."""


@dataclass(frozen=True)
class CapacitySelector:
    """How one kind of cluster marks spot nodes: pods for spot select ``label=value`` and tolerate the taint."""

    name: str
    label: str
    value: str
    taint_effect: str = "NoSchedule"


SPOT_PRESETS = {
    # Karpenter labels every node it launches with its capacity type; clusters that keep spot nodes for
    # interruptible work often add a taint with the same key, so the spot pods tolerate it.
    "karpenter": CapacitySelector("karpenter", "karpenter.sh/capacity-type", "spot"),
    # GKE labels Spot VMs cloud.google.com/gke-spot=true and can taint the node pool with the same pair.
    "gke": CapacitySelector("gke", "cloud.google.com/gke-spot", "true"),
}


def parse_spot_selector(text: str) -> CapacitySelector:
    """``karpenter``, ``gke`` or ``custom=KEY=VALUE`` (a label that marks spot nodes, tolerated as a taint too)."""
    if text in SPOT_PRESETS:
        return SPOT_PRESETS[text]
    kind, _, rest = text.partition("=")
    key, sep, value = rest.partition("=")
    if kind != "custom" or not sep or not key or not value:
        raise RenderError(f"--spot-selector {text!r}: expected one of {', '.join(SPOT_PRESETS)} or "
                          "custom=KEY=VALUE, e.g. custom=node.example.com/lifecycle=spot")
    return CapacitySelector("custom", key, value)


@dataclass(frozen=True)
class RenderOptions:
    config: str
    nodes: int
    gpus_per_node: int
    overrides: tuple[str, ...] = ()
    spot_workers: int = 0
    min_nodes: int | None = None  # default: the on-demand nodes (at least 1)
    kind: str = "trainjob"
    runtime_kind: str = "TrainingRuntime"
    name: str | None = None  # default: posttrain-<recipe>
    namespace: str | None = None
    image: str = ""  # required: the image the user built (check_options says how)
    spot_selectors: tuple[CapacitySelector, ...] = field(default=(SPOT_PRESETS["karpenter"],))
    grace_period_s: int = DEFAULT_GRACE_PERIOD_S
    from_run: str | None = None
    s3_secret: str = "posttrain-s3"
    signing_secret: str = ""  # a Secret whose key `signing-key` signs checkpoint manifests (store.signing_key)
    output_dir: str | None = None
    cpu: str = "8"
    memory: str = "64Gi"
    shm_size: str = "16Gi"
    metrics_port: int = DEFAULT_METRICS_PORT
    max_restarts: int = 5
    backoff_limit: int = 3
    podmonitor: bool = True
    plan: str | None = None  # a `posttrain plan --json` file the manifests quote (and are checked against)
    allow_local_paths: bool = False  # keep local paths in the recipe (baked into the image) with a warning

    @property
    def on_demand_workers(self) -> int:
        return self.nodes - self.spot_workers

    @property
    def elastic_min_nodes(self) -> int:
        return self.min_nodes if self.min_nodes is not None else max(1, self.on_demand_workers)


def check_options(options: RenderOptions) -> None:
    """Raise ``RenderError`` naming the flag to change when ``options`` cannot be rendered."""
    if not options.image.strip():
        raise RenderError(f"--image is required: the pods run the image you built; {IMAGE_HINT}, then pass "
                          "--image REGISTRY/posttrain:TAG")
    if options.nodes < 1:
        raise RenderError(f"--nodes {options.nodes}: a run needs at least one node")
    if options.gpus_per_node < 1:
        raise RenderError(f"--gpus-per-node {options.gpus_per_node}: give the GPUs each node trains on (1 or more)")
    if not 0 <= options.spot_workers <= options.nodes:
        raise RenderError(f"--spot-workers {options.spot_workers}: must be between 0 and --nodes {options.nodes}")
    if not 1 <= options.elastic_min_nodes <= options.nodes:
        raise RenderError(f"--min-nodes {options.elastic_min_nodes}: must be between 1 and --nodes {options.nodes}")
    if options.kind not in KINDS:
        raise RenderError(f"--kind {options.kind!r}: one of {', '.join(KINDS)}")
    if options.runtime_kind not in RUNTIME_KINDS:
        raise RenderError(f"--runtime-kind {options.runtime_kind!r}: one of {', '.join(RUNTIME_KINDS)}")
    if options.name is not None and not _NAME.match(options.name):
        raise RenderError(f"--name {options.name!r}: lowercase letters, digits and '-', starting with a letter, "
                          "at most 40 characters (it prefixes every object's name)")
    if options.grace_period_s < 1:
        raise RenderError(f"--grace-period-s {options.grace_period_s}: must be at least 1 second")
    for flag, port in (("--metrics-port", options.metrics_port),):
        if not 1 <= port <= 65535 or port == RDZV_PORT:
            raise RenderError(f"{flag} {port}: a TCP port other than the rendezvous port {RDZV_PORT}")
    if options.max_restarts < 0 or options.backoff_limit < 0:
        raise RenderError("--max-restarts and --backoff-limit must be 0 or more")
    if not options.spot_selectors and options.spot_workers:
        raise RenderError("--spot-workers needs at least one --spot-selector")
    quantity_bytes(options.memory)
    plan_annotations(options)  # a plan for another shape, or more host memory than requested, stops here


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|K|M|G|T)?$")
_UNITS = {None: 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
PLAN_ANNOTATION = "posttrain.dev/plan"


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity (``64Gi``, ``512M``, ``1e3`` not accepted) in bytes."""
    match = _QUANTITY.match(text)
    if match is None:
        raise RenderError(f"--memory {text!r}: a Kubernetes quantity such as 64Gi or 512Mi")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@functools.lru_cache(maxsize=8)
def plan_annotations(options: RenderOptions) -> dict[str, str]:
    """The plan's figures as annotations, after checking the plan was made for this shape: the same GPUs and
    GPUs per node, and host memory per node within ``--memory`` (with offload, the plan's host share).
    Read once per options (every object of a render quotes it); treat the result as read-only."""
    import json

    if options.plan is None:
        return {}
    try:
        plan = json.loads(Path(options.plan).read_text(encoding="utf-8"))
        inputs, memory, run = plan["inputs"], plan["memory_bytes"], plan["run"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RenderError(f"--plan {options.plan}: not a `posttrain plan --json` file ({exc})") from None
    gpus = options.nodes * options.gpus_per_node
    if (inputs["gpus"], inputs["gpus_per_node"]) != (gpus, options.gpus_per_node):
        raise RenderError(f"--plan {options.plan} is for {inputs['gpus']} GPUs, {inputs['gpus_per_node']} per node; "
                          f"these manifests are for {gpus} ({options.nodes} nodes x {options.gpus_per_node}): "
                          "re-plan, or change --nodes / --gpus-per-node")
    if memory["host_per_node"] > quantity_bytes(options.memory):
        raise RenderError(f"--memory {options.memory}: the plan offloads {memory['host_per_node'] / 2**30:.1f} GiB "
                          "to host memory per node; raise --memory above it")
    summary = {
        "model": plan["model"]["name"], "recipe": inputs["recipe"], "gpus": inputs["gpus"],
        "peak_gib_per_gpu": round(memory["peak_per_gpu"] / 2**30, 1),
        "host_gib_per_node": round(memory["host_per_node"] / 2**30, 1),
        "checkpoint_interval_min": round(run["checkpoint_interval_s"] / 60, 1),
        "goodput": round(run["goodput"], 3), "spot_nodes": run["spot_nodes"],
    }  # fmt: skip
    return {PLAN_ANNOTATION: json.dumps(summary, separators=(",", ":"))}


def job_name(options: RenderOptions, recipe: str) -> str:
    return options.name or f"posttrain-{recipe}".replace("_", "-")


def remote_output_dir(options: RenderOptions, recipe_output_dir: str) -> str:
    """The run's output_dir in the cluster: a URL, because a pod's disk does not survive its node."""
    url = options.output_dir or recipe_output_dir
    if "://" not in url:
        raise RenderError(f"output_dir {url!r} is a local path: a restarted pod lands on another node and would "
                          "not find its checkpoints; pass --output-dir s3://BUCKET/PREFIX")
    return url


def measured_save_seconds(run_dir: str) -> float | None:
    """The longest ``checkpoint_save_s`` in ``run_dir/metrics.jsonl`` (local or fsspec URL), or None."""
    from posttrain.data.io import iter_raw_records

    longest = None
    # iter_raw_records, not read_jsonl: a run killed mid-write leaves a torn last line, which is no reason to stop.
    for _, record in iter_raw_records(f"{run_dir.rstrip('/')}/metrics.jsonl"):
        value = record.get("checkpoint_save_s") if isinstance(record, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            longest = value if longest is None else max(longest, value)
    return longest


def grace_period_from_run(default_s: int, longest_save_s: float | None) -> int:
    """``max(default, 2 × longest save + 60)``: room for a save twice as slow as the slowest seen, plus a minute
    for the step in flight and the upload to finish, before the kubelet sends SIGKILL."""
    if longest_save_s is None:
        return default_s
    return max(default_s, math.ceil(2 * longest_save_s + 60))
