"""A Hugging Face Hub on 127.0.0.1 (HF_ENDPOINT) serving repos from local directories: the three calls
huggingface_hub's ``snapshot_download`` makes (the revision's commit, the file tree, each file's HEAD and GET), and
a log of every request, so a test sees which files a download fetched."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class FakeHub:
    """``repos``: repo id -> (commit hash, directory of its files, recursively). Use as a context manager."""

    def __init__(self, repos: dict[str, tuple[str, Path]]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []  # (method, path) in arrival order
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, *args) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self) -> set[str]:
        """The files whose bytes were downloaded (GET of .../resolve/...)."""
        return {
            path.split("/resolve/", 1)[1].split("/", 1)[1]
            for m, path in self.requests
            if m == "GET" and "/resolve/" in path
        }

    def _files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo][1]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def _answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        self.requests.append((req.command, path))
        if path.startswith("/api/models/"):
            repo, _, rest = path.removeprefix("/api/models/").partition("/revision/")
            if not rest:
                repo, _, rest = path.removeprefix("/api/models/").partition("/tree/")
                kind = "tree"
            else:
                kind = "info"
            if repo not in self.repos:
                return _send(req, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            commit = self.repos[repo][0]
            files = self._files(repo)
            if kind == "info":
                data = {"id": repo, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
            else:
                data = [
                    {"type": "file", "path": f, "size": p.stat().st_size, "oid": _sha1(p.read_bytes())}
                    for f, p in files.items()
                ]
            return _send(req, 200, json.dumps(data).encode(), {"Content-Type": "application/json"}, body)
        repo, _, rest = path.lstrip("/").partition("/resolve/")
        name = rest.split("/", 1)[1] if "/" in rest else ""
        files = self._files(repo) if repo in self.repos else {}
        if name not in files:
            return _send(req, 404, b"not found", {"X-Error-Code": "EntryNotFound"}, body)
        data = files[name].read_bytes()
        headers = {"X-Repo-Commit": self.repos[repo][0], "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        _send(req, 200, data, headers, body)


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _send(req: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict, body: bool) -> None:
    req.send_response(status)
    for k, v in headers.items():
        req.send_header(k, v)
    req.send_header("Content-Length", str(len(data)))
    req.end_headers()
    if body:
        req.wfile.write(data)
