"""``posttrain k8s render --config RECIPE --nodes N --gpus-per-node G [...]``: Kubernetes manifests for a run."""

from __future__ import annotations

import argparse

from posttrain.k8s.options import (
    DEFAULT_GRACE_PERIOD_S,
    DEFAULT_METRICS_PORT,
    KINDS,
    RDZV_PORT,
    RUNTIME_KINDS,
)

RENDER_DESCRIPTION = f"""\
Render the Kubernetes manifests of a training run (nothing is applied; see docs/kubernetes.md).

Every node runs `posttrain launch` (torchrun, elastic over --min-nodes..--nodes) against a c10d rendezvous
store served by a small coordinator Deployment on on-demand nodes (Service <name>-rdzv:{RDZV_PORT}), so
losing spot nodes never loses the rendezvous. --spot-workers K of the N nodes go on spot capacity.
Exit 75 (preempted or stalled, checkpoint saved) restarts the pod without counting a failure.

The pods read nothing from this machine: --image is the image you built and pushed, output_dir is a URL, and
every path in the recipe (model.path, data.train, data.eval, ...) must be a URL (s3://...) or a hub id; a
local path stops the render naming its key, unless --allow-local-paths says it is baked into the image.

Files written to --out (or printed to stdout as one stream when --out is not given):
  common.yaml       recipe ConfigMap, coordinator Deployment + Service
  trainjob.yaml     Kubeflow Trainer v2 TrainingRuntime/ClusterTrainingRuntime + TrainJob per group
  pytorchjob.yaml   training-operator PyTorchJob per group (apply ONE of trainjob.yaml / pytorchjob.yaml)
  podmonitor.yaml   prometheus-operator PodMonitor for /metrics
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    k8s = subparsers.add_parser("k8s", help="Kubernetes: render the manifests of a training run.",
                                description="Kubernetes tools. `posttrain k8s render --help` for the manifests.")
    commands = k8s.add_subparsers(dest="k8s_command", metavar="SUBCOMMAND")
    k8s.set_defaults(func=lambda args: k8s.print_help() or 2)
    parser = commands.add_parser("render", help="Write TrainJob/PyTorchJob, coordinator and PodMonitor YAML.",
                                 description=RENDER_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    run = parser.add_argument_group("the run")
    run.add_argument("--config", required=True,
                     help="YAML recipe: a file, or a packaged recipe's name (see `posttrain recipes list`); its "
                     "text is shipped in a ConfigMap, so a local file works")
    run.add_argument("overrides", nargs="*", metavar="key=value",
                     help="dotted recipe overrides passed to the pods' command, e.g. train.lr=3e-4 (validated now)")
    run.add_argument("--output-dir", help="the run's output_dir in the cluster, an s3://BUCKET/PREFIX URL "
                     "(default: the recipe's output_dir, which must then be a URL)")
    run.add_argument("--name", help="prefix of every object's name and the rendezvous id (default: "
                     "posttrain-<recipe>; lowercase, digits and '-', at most 40 characters)")
    run.add_argument("--namespace", help="metadata.namespace of every object (default: none; kubectl's -n decides)")
    run.add_argument("--image", default="", metavar="IMAGE",
                     help="required: the container image you built from the repository's Dockerfile and pushed "
                     "where the cluster pulls from, e.g. ghcr.io/ORG/posttrain:TAG (posttrain publishes no image, "
                     "so there is no default; docs/kubernetes.md, \"The image\")")
    run.add_argument("--allow-local-paths", action="store_true",
                     help="keep paths of this machine in the recipe (model.path, data.train, ...) instead of "
                     "refusing them, for files baked into the image: each is warned about and must exist at that "
                     "path inside it. Without it, every path a pod cannot reach stops the render (use s3://... "
                     "URLs or hub ids)")
    nodes = parser.add_argument_group("nodes and capacity")
    nodes.add_argument("--nodes", type=int, required=True, help="N: the nodes the run trains on (the most)")
    nodes.add_argument("--gpus-per-node", type=int, required=True,
                       help="G: GPUs per node; one process per GPU (--nproc-per-node), nvidia.com/gpu: G")
    nodes.add_argument("--spot-workers", type=int, default=0,
                       help="K: how many of the N nodes run on spot/preemptible capacity (default 0); the other "
                       "N-K and the coordinator run on on-demand nodes")
    nodes.add_argument("--min-nodes", type=int,
                       help="fewest nodes torchrun keeps training with (--nnodes MIN:N; default: N-K, at least 1)")
    nodes.add_argument("--spot-selector", action="append", dest="spot_selectors", metavar="SELECTOR",
                       help="how spot nodes are labelled and tainted: karpenter (karpenter.sh/capacity-type=spot), "
                       "gke (cloud.google.com/gke-spot=true) or custom=KEY=VALUE; repeat for clusters with "
                       "several (spot pods need any one, on-demand pods none); default: karpenter")
    nodes.add_argument("--cpu", default="8", help="CPU request per node (default 8; no CPU limit is set)")
    nodes.add_argument("--memory", default="64Gi", help="memory request and limit per node (default 64Gi)")
    nodes.add_argument("--shm-size", default="16Gi",
                       help="size of the in-memory /dev/shm volume (emptyDir medium Memory; default 16Gi)")
    jobs = parser.add_argument_group("job kind and restarts")
    jobs.add_argument("--kind", choices=KINDS, default="trainjob",
                      help="trainjob: Kubeflow Trainer v2 TrainJob (default); pytorchjob: training-operator "
                      "PyTorchJob with elasticPolicy; both: write both files (apply only one)")
    jobs.add_argument("--runtime-kind", choices=RUNTIME_KINDS, default="TrainingRuntime",
                      help="the TrainJob's runtime: namespaced TrainingRuntime (default) or cluster-wide "
                      "ClusterTrainingRuntime")
    jobs.add_argument("--grace-period-s", type=int, default=DEFAULT_GRACE_PERIOD_S,
                      help="terminationGracePeriodSeconds: time between SIGTERM and SIGKILL to save a checkpoint "
                      f"(default {DEFAULT_GRACE_PERIOD_S}); must exceed the checkpoint save time")
    jobs.add_argument("--from-run", metavar="DIR",
                      help="an earlier run's output_dir (path or URL): the grace period becomes "
                      "max(--grace-period-s, 2 x the longest checkpoint_save_s in DIR/metrics.jsonl + 60)")
    jobs.add_argument("--max-restarts", type=int, default=5,
                      help="torchrun --max-restarts, PyTorchJob elasticPolicy.maxRestarts and JobSet "
                      "failurePolicy.maxRestarts (default 5)")
    jobs.add_argument("--backoff-limit", type=int, default=3,
                      help="failed pods (other than exit 75 or eviction from a reclaimed node) before a job "
                      "counts as failed (default 3)")
    extras = parser.add_argument_group("storage and monitoring")
    extras.add_argument("--s3-secret", default="posttrain-s3",
                        help="Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and optional AWS_ENDPOINT_URL, "
                        "AWS_DEFAULT_REGION (default posttrain-s3; '' for none, e.g. with IRSA)")
    extras.add_argument("--signing-secret", default="", metavar="NAME",
                        help="Secret whose key `signing-key` signs checkpoint manifests: the pods get it as "
                        "$POSTTRAIN_SIGNING_KEY and the command says store.signing_key=env:POSTTRAIN_SIGNING_KEY "
                        "(required when the recipe sets store.signing_key; docs/security.md)")
    extras.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                        help=f"port of /metrics: metrics.prometheus_port in the command, the container port and "
                        f"the PodMonitor's (default {DEFAULT_METRICS_PORT})")
    extras.add_argument("--podmonitor", action=argparse.BooleanOptionalAction, default=True,
                        help="write podmonitor.yaml (default: yes; --no-podmonitor without prometheus-operator)")
    extras.add_argument("--plan", metavar="PLAN.json",
                        help="a `posttrain plan --json` file: checked against --nodes, --gpus-per-node and --memory "
                        "(offloaded host memory), and quoted in every object's posttrain.dev/plan annotation")
    parser.add_argument("--out", metavar="DIR",
                        help="write the files into DIR (replacing manifests of an earlier render there); "
                        "default: print every document to stdout")
    parser.set_defaults(func=_render)


def options_from_args(args: argparse.Namespace):
    from posttrain.k8s.options import SPOT_PRESETS, RenderOptions, parse_spot_selector

    selectors = tuple(parse_spot_selector(text) for text in (args.spot_selectors or [])) or (
        SPOT_PRESETS["karpenter"],)
    return RenderOptions(
        config=args.config, overrides=tuple(args.overrides), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        spot_workers=args.spot_workers, min_nodes=args.min_nodes, kind=args.kind, runtime_kind=args.runtime_kind,
        name=args.name, namespace=args.namespace, image=args.image, spot_selectors=selectors,
        grace_period_s=args.grace_period_s, from_run=args.from_run, s3_secret=args.s3_secret,
        signing_secret=args.signing_secret,
        output_dir=args.output_dir, cpu=args.cpu, memory=args.memory, shm_size=args.shm_size,
        metrics_port=args.metrics_port, max_restarts=args.max_restarts, backoff_limit=args.backoff_limit,
        podmonitor=args.podmonitor, plan=args.plan, allow_local_paths=args.allow_local_paths)


def _render(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from posttrain.k8s.render import render, to_yaml, write_manifests

    files = render(options_from_args(args))
    if args.out is None:
        sys.stdout.write(to_yaml([doc for documents in files.values() for doc in documents]))
        return 0
    for path in write_manifests(files, Path(args.out)):
        print(f"wrote {path}", file=sys.stderr)
    return 0
