"""An HTTP proxy in front of the loopback S3 server that injects the faults a real object store has.

Point ``AWS_ENDPOINT_URL`` at ``FaultyProxy.endpoint`` and set ``proxy.rules``: each rule is
``(method, path substring, fault, count)``; the first matching rule with ``count`` left (None: always)
applies to a request. Faults:

- ``("status", 503)``: answer with that status and an S3 error body, the request never reaches the store;
- ``"drop"``: read part of the request body, then close the connection (a reset mid-upload);
- ``"blackhole"``: read the body, answer 200 with an ETag, store nothing (a write dropped silently);
- ``("delay", seconds)``: forward after a pause (a slow store).

``proxy.seen`` counts requests by ``(method, fault or "pass")``.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

ERROR_BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
              b"<Message>injected fault</Message></Error>")


class FaultyProxy:
    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.rules: list[list[Any]] = []
        self.seen: Counter = Counter()
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    parts = []  # botocore streams checksummed uploads as HTTP chunks
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline().strip():  # trailers
                                pass
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _handle(self):
                fault = proxy._fault(self.command, self.path)
                with proxy.lock:
                    proxy.seen[(self.command, fault if isinstance(fault, str) else fault[0] if fault else "pass")] += 1
                if fault == "drop":
                    self.rfile.read1(4096)  # part of the upload, then the connection is gone
                    self.close_connection = True
                    self.connection.close()
                    return
                body = self._body()
                if fault == "blackhole":
                    self._reply(200, b"", {"ETag": '"00000000000000000000000000000000"'})
                    return
                if isinstance(fault, tuple) and fault[0] == "status":
                    self._reply(fault[1], ERROR_BODY, {"Content-Type": "application/xml"})
                    return
                if isinstance(fault, tuple) and fault[0] == "delay":
                    time.sleep(fault[1])
                self._forward(body)

            def _forward(self, body: bytes):
                connection = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("expect", "connection", "transfer-encoding", "content-length")}
                if self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                connection.request(self.command, self.path, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
                dropped = ("transfer-encoding", "connection") + (() if self.command == "HEAD" else ("content-length",))
                extra = {k: v for k, v in response.getheaders() if k.lower() not in dropped}
                self._reply(response.status, data, extra)
                connection.close()

            def _reply(self, status: int, data: bytes, headers: dict[str, str]):
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if not any(key.lower() == "content-length" for key in headers):  # a HEAD keeps the object's
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _fault(self, method: str, path: str):
        with self.lock:
            for rule in self.rules:
                rule_method, pattern, fault, count = rule
                if rule_method in (method, "*") and pattern in path and (count is None or count > 0):
                    if count is not None:
                        rule[3] = count - 1
                    return fault
        return None

    def __enter__(self) -> FaultyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
