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

Started with ``--worker-extension-cls`` (``rollout.sync_method: broadcast``), the other ``/collective_rpc``
methods go to posttrain's real worker extension (``posttrain_vllm_ext``, on the ``PYTHONPATH`` ``VLLMServer``
sets) mixed into a stand-in worker whose ``reload_weights`` receives every tensor and keeps none; it appends the
bytes received to ``FAKE_VLLM_RELOADS`` as the file reload does, and ``{name: [dtype, shape, sum]}`` as a JSON
line to ``FAKE_VLLM_RECEIVED``. ``FAKE_VLLM_DIE_IN_RECEIVE``: the k-th start exits (code 9) in its ``N_k``-th
receive, after telling the trainer it is receiving and before the first tensor. Without the flag, a method other
than ``reload_weights`` fails as vLLM's does (HTTP 500, "… has no attribute …").
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
DIE_IN_RECEIVE = _nth("FAKE_VLLM_DIE_IN_RECEIVE", START, -1)
EXTENSION = _arg("--worker-extension-cls")
WORKER = []  # the stand-in worker, made at the first extension call (torch loads only then)
VOCAB = json.loads((Path(_arg("--model")) / "config.json").read_text())["vocab_size"]
COUNT = {"completions": 0}
LOCK = threading.Lock()


def _safetensors_size(directory: str) -> int:
    path = Path(directory) / "model.safetensors"
    with path.open("rb") as handle:
        (header,) = struct.unpack("<Q", handle.read(8))
        json.loads(handle.read(header))  # a valid header, or this raises (HTTP 500)
    return path.stat().st_size


def _record_reload(size: int) -> None:
    if os.environ.get("FAKE_VLLM_RELOADS"):
        with LOCK, open(os.environ["FAKE_VLLM_RELOADS"], "a") as handle:
            handle.write(f"{size}\n")


def _worker():
    """The stand-in worker with posttrain's extension mixed in, as vLLM mixes it into its own."""
    if not WORKER:
        import importlib

        import torch

        module, _, name = EXTENSION.rpartition(".")
        extension = getattr(importlib.import_module(module), name)

        class FakeWorker(extension):
            device = torch.device("cpu")
            receives = 0

            def reload_weights(self, weights_iterator, is_checkpoint_format=True):
                FakeWorker.receives += 1
                if FakeWorker.receives == DIE_IN_RECEIVE:
                    print("fake vllm: dying in a receive as asked", flush=True)
                    os._exit(9)
                seen, size = {}, 0
                for tensor_name, tensor in weights_iterator:
                    seen[tensor_name] = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                                         float(tensor.double().sum())]
                    size += tensor.numel() * tensor.element_size()
                _record_reload(size)
                if os.environ.get("FAKE_VLLM_RECEIVED"):
                    with LOCK, open(os.environ["FAKE_VLLM_RECEIVED"], "a") as handle:
                        handle.write(json.dumps(seen) + "\n")

        WORKER.append(FakeWorker())
    return WORKER[0]


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
        elif self.path == "/collective_rpc" and body["method"] == "reload_weights":
            size = _safetensors_size(body["kwargs"]["weights_path"])
            _record_reload(size)
            self._reply(200, {"results": [None]})
        elif self.path == "/collective_rpc":
            if EXTENSION is None:
                self._reply(500, {"error": {"message": f"Worker failed with error ''FakeWorker' object has no "
                                                       f"attribute '{body['method']}''"}})
                return
            try:
                result = getattr(_worker(), body["method"])(*body.get("args", []), **body.get("kwargs", {}))
            except Exception as exc:  # noqa: BLE001 - as vLLM answers a failed collective_rpc
                self._reply(500, {"error": {"message": f"{type(exc).__name__}: {exc}"}})
                return
            self._reply(200, {"results": [result]})
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
