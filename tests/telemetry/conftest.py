"""Helpers for the telemetry tests: run a real tiny SFT run with the exporter on and scrape it over HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tests.train.conftest import ROOT, env, sft_command, sft_data  # noqa: F401 - the fixture, for these tests

PORT_LINE = re.compile(r"Prometheus /metrics on [^ ]+:(\d+)")
LINGER_LINE = "serving the final metrics until the next scrape"


@dataclass
class Scraped:
    returncode: int
    stderr: str
    text: str  # the exposition fetched while the finished run lingered ("" when it never got there)

    def families(self) -> dict:
        return {family.name: family for family in text_string_to_metric_families(self.text)}

    def samples(self) -> dict[tuple[str, tuple], float]:
        """``{(sample name, sorted labels): value}`` for every sample of the exposition."""
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(self.text) for s in family.samples}

    def value(self, name: str, **labels) -> float:
        return self.samples()[(name, tuple(sorted(labels.items())))]


def run_and_scrape(overrides: list[str], nproc: int = 1, timeout: float = 600) -> Scraped:
    """Run ``posttrain sft`` with the exporter on a free port (``metrics.prometheus_port=0``) and lingering at
    the end; scrape ``/metrics`` once the run says it finished, which also lets it exit."""
    overrides = [*overrides, "metrics.prometheus_port=0", "metrics.prometheus_addr=127.0.0.1",
                 f"metrics.prometheus_linger_s={timeout}"]
    proc = subprocess.Popen(sft_command(overrides, nproc), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    # A hung run fails the test instead of hanging it; the whole group, so torchrun's ranks go too.
    killer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    killer.start()
    lines, port, text = [], None, ""
    try:
        for line in proc.stderr:
            lines.append(line)
            match = PORT_LINE.search(line)
            if match:
                port = int(match.group(1))
            if LINGER_LINE in line and port is not None:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
                    text = response.read().decode()
        returncode = proc.wait()
    finally:
        killer.cancel()
    return Scraped(returncode, "".join(lines), text)
