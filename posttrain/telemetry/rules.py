"""The PrometheusRule (prometheus-operator, ``monitoring.coreos.com/v1``) rendered from the plain rules file.

``deploy/prometheus/alerts.yaml`` is the one source of the alert rules; ``deploy/prometheus/prometheusrule.yaml``
embeds its groups unchanged for clusters that run the operator. Regenerate it after editing the rules:

    python -m posttrain.telemetry.rules deploy/prometheus/alerts.yaml deploy/prometheus/prometheusrule.yaml

(tests/telemetry fails when the two differ).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from posttrain.config.loader import load_yaml

HEADER = ("# Generated from alerts.yaml by `python -m posttrain.telemetry.rules deploy/prometheus/alerts.yaml "
          "deploy/prometheus/prometheusrule.yaml`:\n# edit alerts.yaml, then regenerate (tests/telemetry checks "
          "they agree).\n")


def prometheus_rule(rules: dict, name: str = "posttrain") -> dict:
    """A PrometheusRule object whose ``spec.groups`` are ``rules["groups"]`` (a parsed Prometheus rules file)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "posttrain",
                                              "app.kubernetes.io/component": "alerts"}},
        "spec": {"groups": rules["groups"]},
    }


class _IndentedLists(yaml.SafeDumper):
    """Lists indented under their key, as yamllint (the repo's .yamllint) and kubectl users expect."""

    def increase_indent(self, flow=False, indentless=False):  # noqa: ARG002 - PyYAML's signature
        return super().increase_indent(flow, False)


def render(alerts_yaml: str, source: str = "the rules file") -> str:
    """The PrometheusRule file's text for the rules file's text (``source`` names it in errors)."""
    body = yaml.dump(prometheus_rule(load_yaml(alerts_yaml, source)), Dumper=_IndentedLists, sort_keys=False,
                     width=120, allow_unicode=True)
    return HEADER + "---\n" + body


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-3].strip(), file=sys.stderr)
        return 2
    source, target = map(Path, args)
    target.write_text(render(source.read_text(), str(source)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
