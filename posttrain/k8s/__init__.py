"""Kubernetes manifests for a training run: ``posttrain k8s render`` (see docs/kubernetes.md).

Pure functions that build plain dicts (``render``), dumped as YAML; nothing here talks to a cluster.
``store`` and ``retryable`` are the two small processes the rendered pods run besides ``posttrain launch``.
"""
