from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from posttrain.train.health import Alerts, HealthGuard, zscore


def test_zscore_by_hand():
    history = [1.0, 2.0, 3.0]
    assert abs(zscore(5.0, history) - 3.0) < 1e-12  # mean 2, sample std 1
    assert zscore(7.0, [1.0, 1.0, 1.0]) == 0.0


def test_guard_skips_nonfinite_and_spikes_then_asks_for_rollback():
    guard = HealthGuard(spike_zscore=6.0, window=32, min_history=4, max_consecutive=2)
    for i in range(8):
        assert guard.check(2.0 + 0.01 * (i % 3), 1.0 + 0.01 * (i % 2)).ok
    nan = guard.check(math.nan, 1.0)
    assert not nan.ok and "non-finite" in nan.reason and not nan.rollback
    spike = guard.check(200.0, 1.0)
    assert not spike.ok and "spike" in spike.reason and spike.rollback
    assert guard.check(2.0, 1.0).ok and guard.consecutive_bad == 0


def test_guard_state_round_trip():
    guard = HealthGuard(min_history=2)
    for value in (1.0, 1.1, 0.9):
        guard.check(value, value)
    other = HealthGuard(min_history=2)
    other.load(json.loads(json.dumps(guard.state())))
    assert list(other.losses) == list(guard.losses)


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
