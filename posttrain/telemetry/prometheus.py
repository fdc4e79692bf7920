"""The Prometheus exporter a training run serves on rank 0 (``metrics.prometheus_port``).

Its own ``CollectorRegistry`` (nothing global, so two runs in one process never collide) served over HTTP
from a daemon thread. The loop's ``MetricsSink`` feeds it: every logged step record sets the gauges below,
every finished step moves the step counter and the per-rank heartbeats, checkpoint commits, rollbacks and
alerts move their counters. Every name starts with ``posttrain_`` and ends with its unit where it has one;
docs/metrics.md lists them with the alert rules (deploy/prometheus/alerts.yaml) that read them.

Values are the latest ones (gauges) or running totals since this process started (counters: Prometheus'
``rate``/``increase`` handle the reset a restart brings).
"""

from __future__ import annotations

import math
import socket
import sys
import threading
import time
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

# A logged step record's key -> (metric name, help, factor to the metric's unit).
RECORD_GAUGES: dict[str, tuple[str, str, float]] = {
    "loss": ("posttrain_train_loss", "Training loss of the last logged step (NaN when it was not finite).", 1.0),
    "grad_norm": ("posttrain_grad_norm", "Global gradient norm of the last logged step, before clipping.", 1.0),
    "lr": ("posttrain_learning_rate", "Learning rate of the last logged step.", 1.0),
    "tokens_per_s": ("posttrain_tokens_per_second", "Tokens per second over all ranks, last logged step.", 1.0),
    "step_time_s": ("posttrain_step_duration_seconds", "Wall time of the last logged optimizer step.", 1.0),
    "mfu": ("posttrain_mfu_ratio", "Model FLOP utilisation of the last logged step "
            "(6 FLOPs per trained, 4 per frozen weight and token).", 1.0),
    "data_wait_s": ("posttrain_data_wait_seconds", "Time the last logged step waited for its batch "
                    "(source.next_step: data loading, or rollouts in RL).", 1.0),
    "peak_memory_mb": ("posttrain_peak_memory_bytes", "Peak memory of rank 0 (GPU allocated, or RSS on CPU).",
                       2.0**20),
    "moe/aux_loss": ("posttrain_moe_aux_loss", "Mixture of experts: the load-balancing loss per token, unweighted, "
                     "last logged step (model.moe.aux_loss_weight > 0).", 1.0),
    "moe/z_loss": ("posttrain_moe_z_loss", "Mixture of experts: the router z-loss per token, unweighted, last "
                   "logged step (model.moe.z_loss_weight > 0).", 1.0),
}


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass  # a scrape every 15 s must not write a line to stderr


class _Body:
    """A WSGI response body that reports when the server has finished sending it (``close`` is called
    then, by the WSGI contract), so a lingering exporter knows its final values reached the scraper."""

    def __init__(self, chunks, sent):
        self.chunks, self.sent = chunks, sent

    def __iter__(self):
        return iter(self.chunks)

    def close(self) -> None:
        self.sent()


class PrometheusExporter:
    """``/metrics`` on ``addr:port`` (port 0: any free port; ``self.port`` is the one bound)."""

    def __init__(self, port: int, addr: str = "0.0.0.0", total_steps: int = 0, start_step: int = 0,
                 world_size: int = 1):
        from prometheus_client import CollectorRegistry, Counter, Gauge
        from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

        from posttrain.telemetry.gpu import GpuCollector

        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.record_gauges = {key: (Gauge(name, doc, registry=registry), factor)
                              for key, (name, doc, factor) in RECORD_GAUGES.items()}
        self.expert_load = Gauge("posttrain_moe_expert_load_ratio", "Mixture of experts: the busiest expert's "
                                 "tokens over the mean, by MoE layer, last logged step (1 = balanced).",
                                 ["layer"], registry=registry)
        self.expert_entropy = Gauge("posttrain_moe_expert_load_entropy", "Mixture of experts: normalised entropy of "
                                    "the tokens per expert, by MoE layer, last logged step (1 = balanced).",
                                    ["layer"], registry=registry)
        self.eval_value = Gauge("posttrain_eval_value", "Last held-out evaluation figure, by name (eval/<metric>).",
                                ["metric"], registry=registry)
        self.step = Gauge("posttrain_step", "Optimizer steps done (the next step to run).", registry=registry)
        self.total_steps = Gauge("posttrain_total_steps", "Optimizer steps the run will do.", registry=registry)
        self.world_size = Gauge("posttrain_world_size", "Ranks in this run.", registry=registry)
        self.steps = Counter("posttrain_steps", "Steps finished by this process (trained or skipped).",
                             registry=registry)
        self.skipped = Counter("posttrain_skipped_updates", "Updates the health guard skipped.", registry=registry)
        self.nonfinite = Counter("posttrain_nonfinite_steps", "Updates whose loss or gradient norm was NaN or "
                                 "infinite (each also counts as a skipped update).", registry=registry)
        self.rollbacks = Counter("posttrain_rollbacks", "Rollbacks to the last good checkpoint.", registry=registry)
        self.alerts = Counter("posttrain_alerts", "Alert events (alerts.jsonl), by kind.", ["kind"],
                              registry=registry)
        self.checkpoints = Counter("posttrain_checkpoints", "Checkpoints committed by this process.",
                                   registry=registry)
        self.checkpoint_time = Gauge("posttrain_checkpoint_last_commit_timestamp_seconds",
                                     "Unix time the last checkpoint was committed; until the first commit of this "
                                     "process, the time it started (so the age counts time without a checkpoint).",
                                     registry=registry)
        self.checkpoint_step = Gauge("posttrain_checkpoint_last_step", "Step of the last committed checkpoint.",
                                     registry=registry)
        self.checkpoint_save = Gauge("posttrain_checkpoint_save_duration_seconds",
                                     "Wall time the last checkpoint took to save and commit.", registry=registry)
        self.heartbeat = Gauge("posttrain_heartbeat_timestamp_seconds",
                               "Unix time each rank finished its last step (gathered on rank 0 every step).",
                               ["rank"], registry=registry)
        self.allreduce = Gauge("posttrain_allreduce_latency_seconds",
                               "Wall time of the last timed small all-reduce (every metrics.allreduce_probe_every "
                               "steps; 0 until the first probe, and in a one-process run).", registry=registry)
        registry.register(GpuCollector())
        self.total_steps.set(total_steps)
        self.step.set(start_step)
        self.world_size.set(world_size)
        self.checkpoint_time.set(time.time())

        self._scraped = threading.Event()
        self._closing = False
        app = make_wsgi_app(registry)

        def serve(environ, start_response):
            chunks = app(environ, start_response)
            return _Body(chunks, self._scraped.set if self._closing else lambda: None)

        server_class = ThreadingWSGIServer
        if ":" in addr:  # an IPv6 address such as ::
            server_class = type("ThreadingWSGIServer6", (ThreadingWSGIServer,), {"address_family": socket.AF_INET6})
        self.server = make_server(addr, port, serve, server_class, handler_class=_QuietHandler)
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, name="posttrain-prometheus", daemon=True)
        self.thread.start()

    def observe(self, record: dict[str, Any]) -> None:
        """A logged record: a step's figures (the gauges above) or an evaluation (``eval/<metric>``)."""
        for key, value in record.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key in self.record_gauges:
                gauge, factor = self.record_gauges[key]
                gauge.set(value * factor)
            elif key.startswith("eval/"):
                self.eval_value.labels(metric=key.removeprefix("eval/")).set(value)
            elif key.startswith("moe/layer"):  # moe/layer<i>/load_max|load_mean|load_entropy (posttrain.train.router)
                layer, name = key.removeprefix("moe/layer").split("/", 1)
                if name == "load_entropy":
                    self.expert_entropy.labels(layer=layer).set(value)
                elif name == "load_max" and record.get(f"moe/layer{layer}/load_mean"):
                    self.expert_load.labels(layer=layer).set(value / record[f"moe/layer{layer}/load_mean"])

    def step_finished(self, next_step: int, losses_and_norms: list[tuple[float, float, bool]]) -> None:
        """A step ended: ``(loss, grad_norm, applied)`` of each of its updates (none for a step skipped by
        ``health.skip_steps``)."""
        self.step.set(next_step)
        self.steps.inc()
        for loss, grad_norm, applied in losses_and_norms:
            if not applied:
                self.skipped.inc()
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                self.nonfinite.inc()

    def heartbeats(self, times: list[float]) -> None:
        for rank, when in enumerate(times):
            self.heartbeat.labels(rank=str(rank)).set(when)

    def checkpoint_committed(self, step: int, save_s: float, committed_at: float) -> None:
        self.checkpoints.inc()
        self.checkpoint_time.set(committed_at)
        self.checkpoint_step.set(step)
        self.checkpoint_save.set(save_s)

    def rolled_back(self, to_step: int) -> None:
        self.rollbacks.inc()
        self.step.set(to_step)

    def alert(self, event: dict[str, Any]) -> None:
        """An ``Alerts`` listener: count each event by kind."""
        self.alerts.labels(kind=str(event.get("kind", "unknown"))).inc()

    def close(self, linger_s: float = 0.0) -> bool:
        """Stop serving; with ``linger_s`` > 0 first wait (at most that long) until one scrape has fetched the
        final values — a short run otherwise ends between two scrapes and its last figures are never seen.
        Returns whether such a scrape came."""
        scraped = False
        if linger_s > 0:
            self._closing = True  # before saying so: a scrape that follows the line below must count
            print(f"[posttrain] metrics: run finished; serving the final metrics until the next scrape (at most "
                  f"{linger_s:g} s)", file=sys.stderr, flush=True)
            scraped = self._scraped.wait(linger_s)
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
        return scraped
