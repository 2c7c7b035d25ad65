"""A loopback HTTP server that speaks the Bright Data SERP protocol, with injectable faults.

Used by the tests and the benchmarks (and handy for a demo without a key): ``POST /request`` with a Bearer key and
``{zone, url, format}``; answers ``{"organic": [{"title", "link", "description"}, ...]}`` built from a
``{query: "Page 1: ...\\nPage 2: ..."}`` mapping (e.g. the reference search cache). Faults are queued per request:

  ("ok",)                       a good response
  ("status", code, headers)     an HTTP error, e.g. ("status", 429, {"Retry-After": "1"}) or ("status", 503, {})
  ("slow", seconds)             sleep, then a good response (client timeouts)
  ("truncated",)                a 200 whose JSON body is cut in half
  ("reset",)                    close the connection abruptly (TCP RST) without a response
"""

import http.server
import json
import socket
import struct
import threading
import time
import urllib.parse


def organic_from_text(text: str) -> list[dict]:
    """Inverts the tool's formatting: ``Page k: snippet`` lines back into organic results."""
    items = []
    if text == "No search results found.":
        return items
    for k, line in enumerate(text.split("\n"), start=1):
        snippet = line.split(": ", 1)[1] if line.startswith("Page ") and ": " in line else line
        items.append({"title": f"Result {k}", "link": f"https://example.org/{k}", "description": snippet})
    return items


class FakeBrightData:
    """Start with ``with FakeBrightData(results, api_key=...) as server:``; ``server.url`` is the base URL."""

    def __init__(self, results: dict[str, str] | None = None, api_key: str | None = None):
        self.results = dict(results or {})
        self.api_key = api_key
        self.faults: list[tuple] = []
        self.requests: list[dict] = []  # {"headers": ..., "body": ..., "query": ...} per request received
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/request"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def push_faults(self, *faults: tuple) -> None:
        with self._lock:
            self.faults.extend(faults)

    def _next_fault(self) -> tuple:
        with self._lock:
            return self.faults.pop(0) if self.faults else ("ok",)

    def _record(self, entry: dict) -> None:
        with self._lock:
            self.requests.append(entry)

    def _handler_class(self):
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output quiet
                pass

            def setup(self):
                super().setup()
                # Headers and body go out as two writes; without this, Nagle + delayed ACK add 40 ms per call.
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                params = urllib.parse.parse_qs(urllib.parse.urlsplit(body.get("url", "")).query)
                query = params.get("q", [""])[0]
                fake._record({"headers": dict(self.headers), "body": body, "params": params, "query": query,
                              "path": self.path})
                if fake.api_key is not None and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                    return self._send(401, b'{"error": "unauthorized"}')
                fault = fake._next_fault()
                kind = fault[0]
                if kind == "status":
                    return self._send(fault[1], b'{"error": "injected"}', fault[2] if len(fault) > 2 else {})
                if kind == "reset":
                    # SO_LINGER with a zero timeout turns close() into a TCP RST.
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return None
                if kind == "slow":
                    time.sleep(fault[1])
                payload = json.dumps({"general": {"query": query},
                                      "organic": organic_from_text(fake.results[query])
                                      if query in fake.results else []}).encode()
                if kind == "truncated":
                    payload = payload[: len(payload) // 2]
                return self._send(200, payload)

            def _send(self, code: int, payload: bytes, headers: dict | None = None):
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:  # the client gave up (timeout test)
                    self.close_connection = True

        return Handler


def free_port() -> int:
    """A loopback port with nothing listening on it (for connection-refused tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
