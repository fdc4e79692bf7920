"""Run telemetry beyond ``metrics.jsonl``: the Prometheus exporter (``prometheus``), GPU figures from NVML
(``gpu``), experiment trackers — TensorBoard, W&B, MLflow — behind one interface (``trackers``), and the
PrometheusRule rendered from the alert rules (``rules``). ``posttrain.train.metrics.MetricsSink`` is the one
place the loop hands its records to; it fans them out to these. Nothing here is imported unless configured
(``metrics.*``), and every optional package says how to install it when it is missing. docs/metrics.md."""
