from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from posttrain.train.health import Alerts, HealthGuard


def test_guard_skips_nonfinite_and_spikes_then_asks_for_rollback():
    guard = HealthGuard(spike_ratio=10.0, window=32, max_consecutive=2)
    assert guard.check(2.0, 1.0).ok  # the first step has nothing to compare with
    nan = guard.check(math.nan, 1.0)
    assert not nan.ok and "non-finite" in nan.reason and not nan.rollback
    spike = guard.check(2.0, 10.5)  # 10.5x the largest grad norm so far: from the second step on
    assert not spike.ok and "spike" in spike.reason and "grad norm" in spike.reason and spike.rollback
    assert guard.check(2.0, 1.0).ok and guard.consecutive_bad == 0


def test_ordinary_dynamics_are_not_spikes():
    guard = HealthGuard()
    # A loss that falls fast and a gradient norm that rises several-fold as learning starts (DPO, RM).
    losses = [8.0 * 0.8**i for i in range(40)]
    norms = [0.3 * min(10.0, 1.15**i) for i in range(40)]
    assert all(guard.check(loss, norm).ok for loss, norm in zip(losses, norms, strict=True))


def test_the_window_forgets_old_maxima():
    guard = HealthGuard(spike_ratio=10.0, window=4)
    guard.check(1.0, 50.0)  # a large first gradient norm, as SFT's first step often has
    for _ in range(4):
        assert guard.check(1.0, 1.0).ok
    assert not guard.check(1.0, 11.0).ok  # the 50 has left the window: 11x the recent max is a spike


def test_guard_state_round_trip():
    guard = HealthGuard()
    for value in (1.0, 1.1, 0.9):
        guard.check(value, value)
    other = HealthGuard()
    other.load(json.loads(json.dumps(guard.state())))
    assert list(other.losses) == list(guard.losses) and list(other.grad_norms) == list(guard.grad_norms)


def test_alerts_file_and_webhook(tmp_path):
    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    alerts = Alerts(tmp_path / "alerts.jsonl", f"http://127.0.0.1:{server.server_port}/hook")
    alerts.emit("skipped_update", step=3, reason="spike")
    thread.join(timeout=10)
    server.server_close()
    lines = [json.loads(x) for x in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "skipped_update" and lines[0]["step"] == 3
    assert received and received[0]["reason"] == "spike"


def test_webhook_down_does_not_raise(tmp_path):
    alerts = Alerts(tmp_path / "alerts.jsonl", "http://127.0.0.1:9/nothing", timeout_s=0.5)
    alerts.emit("rollback", step=1)
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert kinds == ["rollback", "webhook_failed"]
