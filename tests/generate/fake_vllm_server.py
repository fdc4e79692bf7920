"""A stand-in for vLLM's OpenAI-compatible server (stdlib only), for the engine-management tests that must not
wait a minute for a real engine: the endpoints posttrain uses, answered from a seeded uniform sampler.

Run as ``python fake_vllm_server.py -m vllm.entrypoints.openai.api_server --model DIR --port P …`` (what
``VLLMServer`` runs, through a wrapper script passed as ``rollout.engine_python``). Behaviour knobs, from the
environment:

- ``FAKE_VLLM_STARTS``: a file; each start appends a line, so a test can count starts;
- ``FAKE_VLLM_DIE_AFTER``: ``N`` or ``N,M,…`` — the k-th start exits (code 9) while answering its
  ``N_k``-th completion request (``-1``: never); ``FAKE_VLLM_FAIL_START``: the same list, 1 = exit at once;
- ``FAKE_VLLM_RELOADS``: a file; each ``reload_weights`` appends the size of the safetensors it found;
- ``FAKE_VLLM_DELAY_S``: each completion request takes this long (an engine busy sampling);
- ``FAKE_VLLM_TIMES``: a file; each completion request appends ``start end`` (``time.time()``) when it is answered.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def _arg(name: str, default: str | None = None) -> str | None:
    argv = sys.argv
    return argv[argv.index(name) + 1] if name in argv else default


def _nth(variable: str, start: int, default: int) -> int:
    values = [v for v in os.environ.get(variable, "").split(",") if v.strip()]
    return int(values[start]) if start < len(values) else default


STARTS = os.environ.get("FAKE_VLLM_STARTS")
START = 0
if STARTS:
    path = Path(STARTS)
    START = len(path.read_text().splitlines()) if path.exists() else 0
    with path.open("a") as handle:
        handle.write(f"{os.getpid()}\n")
if _nth("FAKE_VLLM_FAIL_START", START, 0) == 1:
    print("fake vllm: failing at start as asked", flush=True)
    sys.exit(3)
DIE_AFTER = _nth("FAKE_VLLM_DIE_AFTER", START, -1)
VOCAB = json.loads((Path(_arg("--model")) / "config.json").read_text())["vocab_size"]
COUNT = {"completions": 0}
LOCK = threading.Lock()


def _safetensors_size(directory: str) -> int:
    path = Path(directory) / "model.safetensors"
    with path.open("rb") as handle:
        (header,) = struct.unpack("<Q", handle.read(8))
        json.loads(handle.read(header))  # a valid header, or this raises (HTTP 500)
    return path.stat().st_size


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _reply(self, code: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self._reply(200, {}) if self.path == "/health" else self._reply(404, {"error": "not found"})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/v1/completions":
            with LOCK:  # requests arrive on several threads at once
                COUNT["completions"] += 1
                count = COUNT["completions"]
            if count == DIE_AFTER:
                print("fake vllm: dying as asked", flush=True)
                os._exit(9)
            started = time.time()
            time.sleep(float(os.environ.get("FAKE_VLLM_DELAY_S", "0")))
            reply = self._complete(body)
            if os.environ.get("FAKE_VLLM_TIMES"):
                with LOCK, open(os.environ["FAKE_VLLM_TIMES"], "a") as handle:
                    handle.write(f"{started} {time.time()}\n")
            self._reply(200, reply)
        elif self.path == "/collective_rpc":
            size = _safetensors_size(body["kwargs"]["weights_path"])
            if os.environ.get("FAKE_VLLM_RELOADS"):
                with open(os.environ["FAKE_VLLM_RELOADS"], "a") as handle:
                    handle.write(f"{size}\n")
            self._reply(200, {"results": [None]})
        elif self.path == "/reset_prefix_cache":
            self._reply(200, {"success": True})
        else:
            self._reply(404, {"error": "not found"})

    def _complete(self, body) -> dict:
        choices = []
        for index in range(int(body.get("n", 1))):
            rng = random.Random((body.get("seed") or 0) + index)
            tokens = [rng.randrange(3, VOCAB) for _ in range(int(body["max_tokens"]))]
            choice = {"index": index, "text": "", "token_ids": tokens, "finish_reason": "length", "stop_reason": None}
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"token_logprobs": [-math.log(VOCAB)] * len(tokens)}
            choices.append(choice)
        return {"choices": choices}


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(_arg("--port"))), Handler)
    print(f"fake vllm: start {START} serving on {server.server_address}", flush=True)
    server.serve_forever()
