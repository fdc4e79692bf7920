"""Rebuild the vendored JSON schemas in this folder from their upstream sources (see README.md).

    python deploy/schemas/extract.py SOURCE_DIR

SOURCE_DIR holds the upstream files, fetched at the commits README.md names:

    trainjobs.yaml, trainingruntimes.yaml, clustertrainingruntimes.yaml   (kubeflow/trainer v2.3.0)
    pytorchjobs.yaml                                                      (kubeflow/trainer v1.9.4)
    podmonitors.yaml, prometheusrules.yaml                                (prometheus-operator v0.93.0)
    swagger.json                                                          (kubernetes-client/python v36.0.3,
                                                                           kubernetes/swagger.json.unprocessed)

What it changes, and why (nothing else is edited):
- every ``description`` is dropped: the schemas are for validation, and the text would make them ~4x larger;
- from the CRDs only ``spec.versions[*].schema.openAPIV3Schema`` of the served versions is kept;
- the core kinds (Service, Deployment, ConfigMap) are the Swagger definition plus every definition it
  reaches through ``$ref``, in one file with a ``definitions`` table; Kubernetes' two special string
  formats are written as JSON schema can check them: IntOrString → integer or string, Quantity → string or
  number (the API server accepts ``cpu: 4`` as well as ``cpu: "4"``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent

CRDS = {
    "trainjobs.yaml": "trainer.kubeflow.org",
    "trainingruntimes.yaml": "trainer.kubeflow.org",
    "clustertrainingruntimes.yaml": "trainer.kubeflow.org",
    "pytorchjobs.yaml": "kubeflow.org",
    "podmonitors.yaml": "monitoring.coreos.com",
    "prometheusrules.yaml": "monitoring.coreos.com",
}
CORE_KINDS = {
    ("v1", "Service"): "io.k8s.api.core.v1.Service",
    ("v1", "ConfigMap"): "io.k8s.api.core.v1.ConfigMap",
    ("apps/v1", "Deployment"): "io.k8s.api.apps.v1.Deployment",
}
SPECIAL_FORMATS = {
    "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {"type": ["integer", "string"]},
    "io.k8s.apimachinery.pkg.api.resource.Quantity": {"type": ["string", "number"]},
}


def without_descriptions(node):
    """``node`` with every ``description`` key removed (a property *named* description is kept)."""
    if isinstance(node, dict):
        return {key: (without_descriptions(value) if key != "properties" else
                      {name: without_descriptions(sub) for name, sub in value.items()})
                for key, value in node.items() if key != "description" or not isinstance(value, str)}
    if isinstance(node, list):
        return [without_descriptions(item) for item in node]
    return node


def file_name(api_version: str, kind: str) -> str:
    return f"{api_version.replace('/', '_')}_{kind}.json"


def write(api_version: str, kind: str, schema: dict) -> None:
    schema = {"$schema": "http://json-schema.org/draft-07/schema#",
              "x-posttrain-kind": {"apiVersion": api_version, "kind": kind}, **schema}
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    (HERE / file_name(api_version, kind)).write_text(text + "\n", encoding="utf-8")


def extract_crd(path: Path) -> None:
    crd = next(doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc)
    kind, group = crd["spec"]["names"]["kind"], crd["spec"]["group"]
    for version in crd["spec"]["versions"]:
        if version.get("served", True):
            write(f"{group}/{version['name']}", kind, without_descriptions(version["schema"]["openAPIV3Schema"]))


def _refs(node, found: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.add(ref.rsplit("/", 1)[-1])
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for item in node:
            _refs(item, found)


def extract_core(swagger: dict) -> None:
    definitions = swagger["definitions"]
    for (api_version, kind), root in CORE_KINDS.items():
        needed, queue = set(), [root]
        while queue:
            name = queue.pop()
            if name in needed:
                continue
            needed.add(name)
            found: set[str] = set()
            _refs(definitions[name], found)
            queue.extend(found - needed)
        table = {name: SPECIAL_FORMATS.get(name, without_descriptions(definitions[name])) for name in sorted(needed)}
        write(api_version, kind, {"$ref": f"#/definitions/{root}", "definitions": table})


def main(source: Path) -> None:
    for name in CRDS:
        extract_crd(source / name)
    extract_core(json.loads((source / "swagger.json").read_text(encoding="utf-8")))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
