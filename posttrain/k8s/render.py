"""``render(options)``: the manifests of one training run, as ``{file name: [documents]}``; ``to_yaml`` and
``write_manifests`` turn them into files.

Files (``kubectl apply -f`` each you want; see docs/kubernetes.md):
- ``common.yaml``: the recipe (ConfigMap) and the rendezvous coordinator (Deployment + Service);
- ``trainjob.yaml``: Kubeflow Trainer v2 runtimes + TrainJobs (``--kind trainjob`` or ``both``);
- ``pytorchjob.yaml``: training-operator PyTorchJobs (``--kind pytorchjob`` or ``both``; apply one kind only);
- ``podmonitor.yaml``: the PodMonitor (needs prometheus-operator's CRDs; ``--no-podmonitor`` leaves it out).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from posttrain import __version__
from posttrain.k8s.coordinator import coordinator_deployment, coordinator_service, rdzv_endpoint
from posttrain.k8s.monitoring import pod_monitor
from posttrain.k8s.options import (
    RenderError,
    RenderOptions,
    check_options,
    grace_period_from_run,
    job_name,
    measured_save_seconds,
    remote_output_dir,
)
from posttrain.k8s.paths import check_pod_paths
from posttrain.k8s.pods import (
    RECIPE_FILE,
    SIGNING_KEY_ENV,
    SIGNING_SECRET_KEY,
    labels,
    metadata,
    worker_groups,
)
from posttrain.k8s.pytorchjob import pytorch_job
from posttrain.k8s.trainjob import runtime, train_job

PROMETHEUS_PORT_KEY = "metrics.prometheus_port"


@dataclass(frozen=True)
class Recipe:
    """The recipe as the pods will run it: its command, its file's text, and the overrides to pass."""

    command: str  # the posttrain subcommand (`sft`, `dpo`, …)
    text: str
    overrides: tuple[str, ...]
    output_dir: str


def resolve(options: RenderOptions) -> Recipe:
    """Validate the recipe with every override the pods will get (so a typo fails here, not in the cluster)."""
    from posttrain.config import RECIPES, resolve_recipe
    from posttrain.config.keys import config_keys
    from posttrain.recipes import find_recipe

    path = find_recipe(options.config)
    user = list(options.overrides)
    name, config = resolve_recipe(path, user)
    output_dir = remote_output_dir(options, str(config.output_dir))
    extra = [f"output_dir={output_dir}"]
    extra += signing_overrides(options, config)
    if any(key.key == PROMETHEUS_PORT_KEY for key in config_keys(RECIPES[name].schema)):
        extra.append(f"{PROMETHEUS_PORT_KEY}={options.metrics_port}")
    else:  # recipes without the Prometheus exporter: the PodMonitor finds nothing to scrape
        print(f"posttrain k8s render: the `{name}` recipe has no {PROMETHEUS_PORT_KEY}; its pods will not serve "
              "/metrics", file=sys.stderr)
    _, pods_config = resolve_recipe(path, [*user, *extra])
    check_pod_paths(pods_config, options.allow_local_paths)  # the config as the pods will read it
    return Recipe(name, path.read_text(encoding="utf-8"), (*user, *extra), output_dir)


def signing_overrides(options: RenderOptions, config) -> list[str]:
    """``store.signing_key`` as the pods will have it: the variable ``--signing-secret`` fills. A recipe that
    signs its manifests with a key the pods would not have is refused here, not at the first checkpoint."""
    store = getattr(config, "store", None)
    wanted = getattr(store, "signing_key", None)
    if options.signing_secret:
        if store is None:
            raise RenderError(f"--signing-secret: the `{config.recipe}` recipe writes no checkpoints to sign")
        return [f"store.signing_key=env:{SIGNING_KEY_ENV}"]
    if wanted:
        raise RenderError(f"the recipe signs checkpoint manifests (store.signing_key={wanted}), which the pods would "
                          f"not have: give --signing-secret NAME, a Secret with the key `{SIGNING_SECRET_KEY}` "
                          f"(kubectl create secret generic NAME --from-literal={SIGNING_SECRET_KEY}=$(openssl rand "
                          "-hex 32)); the pods get it as $" + SIGNING_KEY_ENV)
    return []


def launch_command(options: RenderOptions, job: str, recipe: Recipe) -> list[str]:
    """``posttrain launch`` (torchrun, exit 75 on preemption) of the recipe, elastic over MIN:MAX nodes."""
    return ["posttrain", "launch",
            "--nnodes", f"{options.elastic_min_nodes}:{options.nodes}",
            "--nproc-per-node", str(options.gpus_per_node),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", rdzv_endpoint(job),
            "--rdzv-id", job,
            # Every agent is a client of the coordinator's store; none may try to serve it.
            "--rdzv-conf", "is_host=false",
            "--max-restarts", str(options.max_restarts),
            "--", recipe.command, "--config", RECIPE_FILE, *recipe.overrides]


def recipe_config_map(name: str, job: str, options: RenderOptions, recipe: Recipe) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(name, options, labels(job, "recipe")),
            "data": {"recipe.yaml": recipe.text}}


def grace_period(options: RenderOptions) -> int:
    longest = measured_save_seconds(options.from_run) if options.from_run else None
    return grace_period_from_run(options.grace_period_s, longest)


def render(options: RenderOptions, recipe: Recipe | None = None) -> dict[str, list[dict]]:
    check_options(options)
    recipe = recipe or resolve(options)
    job = job_name(options, recipe.command)
    config_map = f"{job}-recipe"
    grace = grace_period(options)
    command = launch_command(options, job, recipe)
    files: dict[str, list[dict]] = {"common.yaml": [recipe_config_map(config_map, job, options, recipe),
                                                    coordinator_service(job, options),
                                                    coordinator_deployment(job, options)]}
    groups = worker_groups(options)
    if options.kind in ("trainjob", "both"):
        files["trainjob.yaml"] = [doc for group in groups for doc in (
            runtime(f"{job}-{group.suffix}", job, group, options, config_map, grace),
            train_job(f"{job}-{group.suffix}", job, group, options, command))]
    if options.kind in ("pytorchjob", "both"):
        files["pytorchjob.yaml"] = [pytorch_job(f"{job}-{group.suffix}", job, group, options, config_map, grace,
                                                command) for group in groups]
    if options.podmonitor:
        files["podmonitor.yaml"] = [pod_monitor(job, options)]
    return files


class _Dumper(yaml.SafeDumper):
    """Block style that yamllint's defaults accept: list items indented under their key, text as ``|``."""

    def increase_indent(self, flow: bool = False, indentless: bool = False):
        return super().increase_indent(flow, False)


def _text(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)

HEADER = f"# Rendered by `posttrain k8s render` (posttrain {__version__}); render again rather than edit.\n"


def to_yaml(documents: list[dict]) -> str:
    body = yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=110,
                         default_flow_style=False, allow_unicode=True)
    return HEADER + body


MANIFEST_FILES = ("common.yaml", "trainjob.yaml", "pytorchjob.yaml", "podmonitor.yaml")


def write_manifests(files: dict[str, list[dict]], out: Path) -> list[Path]:
    """Write ``files`` into ``out``; remove the manifests an earlier render left there that this one lacks
    (else ``kubectl apply -f OUT`` would start a job of the kind no longer asked for)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in set(MANIFEST_FILES) - set(files):
        (out / stale).unlink(missing_ok=True)
    written = []
    for name, documents in files.items():
        path = out / name
        path.write_text(to_yaml(documents), encoding="utf-8")
        written.append(path)
    return written
