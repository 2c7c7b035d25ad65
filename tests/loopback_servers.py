"""HTTP servers on loopback that serve real files over the protocols the real clients speak, for
`tests/test_data_fetch.py`: plain HTTP with byte ranges (raw.githubusercontent.com's, for `requests`) and the
Hugging Face hub's file API (`HEAD`/`GET /datasets/<repo>/resolve/<revision>/<file>` with the `X-Repo-Commit`,
`X-Linked-Etag` and `X-Linked-Size` headers `huggingface_hub.hf_hub_download` reads).

Faults, per served path: `drop` (the first response stops halfway and the connection closes), `corrupt` (one byte
flipped, every time), `missing` (404). `requests` records (method, path, Range header) of every request."""

from __future__ import annotations

import hashlib
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Loopback:
    """A server of `files` (URL path without the leading slash -> local file) on 127.0.0.1."""

    def __init__(self, files: dict[str, Path]):
        self.files = {k: Path(v) for k, v in files.items()}
        self.drop: set[str] = set()
        self.corrupt: set[str] = set()
        self.missing: set[str] = set()
        self.requests: list[tuple[str, str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                server.handle(self, head=True)

            def do_GET(self):
                server.handle(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def key(self, path: str) -> str:
        """The served file's key for a request path (the hub's resolve URL maps to its file name's key)."""
        return path.lstrip("/").split("?")[0]

    def extra_headers(self, key: str, data: bytes) -> dict[str, str]:
        return {"ETag": f'"{hashlib.sha256(data).hexdigest()}"'}

    def handle(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        key = self.key(h.path)
        self.requests.append((h.command, key, h.headers.get("Range", "")))
        if key not in self.files or key in self.missing:
            body = b"Entry not found"
            h.send_response(404)
            h.send_header("Content-Length", str(len(body)))
            h.send_header("X-Error-Code", "EntryNotFound")
            h.end_headers()
            if not head:
                h.wfile.write(body)
            return
        data = self.files[key].read_bytes()
        headers = self.extra_headers(key, data)  # of the true file: a corrupted copy does not match them
        if key in self.corrupt:
            data = data[: len(data) // 3] + bytes([data[len(data) // 3] ^ 0xFF]) + data[len(data) // 3 + 1:]
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        if match and not head:
            start = int(match.group(1))
        h.send_response(206 if start else 200)
        for name, value in headers.items():
            h.send_header(name, value)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        body = data[start:]
        if key in self.drop and not start:
            self.drop.discard(key)
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the connection dropped mid-file
            return
        h.wfile.write(body)


class HubLoopback(Loopback):
    """The hub's file API for dataset repositories: `files` keys are `<repo_id>/<file name>`."""

    def key(self, path: str) -> str:
        match = re.fullmatch(r"/datasets/(.+?)/resolve/([^/]+)/(.+)", path.split("?")[0])
        return f"{match.group(1)}/{match.group(3)}" if match else path.lstrip("/")

    def extra_headers(self, key: str, data: bytes) -> dict[str, str]:
        sha = hashlib.sha256(data).hexdigest()  # an LFS file: the hub's etag is its sha256
        return {"ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                "X-Repo-Commit": COMMIT}
