"""A local stand-in for the Hugging Face Hub, served over HTTP on 127.0.0.1.

It speaks the part of the Hub's protocol that ``huggingface_hub`` uses to download repositories
(``snapshot_download``, ``hf_hub_download``):

* ``GET /api/{models,datasets}/{repo}[/revision/{rev}]``: the repo info, with ``sha`` (the commit
  the revision resolves to) and ``siblings`` (the file list);
* ``GET /api/{models,datasets}/{repo}/tree/{rev}[/{path}]``: the file tree (``type``, ``path``,
  ``size``, ``oid`` and, for large files, ``lfs`` with the sha256);
* ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` (``/datasets/{repo}/...`` for datasets): the file,
  with ``X-Repo-Commit``, ``ETag`` (the git blob id, or the sha256 for large files, which also get
  ``X-Linked-Etag``/``X-Linked-Size``), ``Content-Length`` and byte ranges;
* errors as the Hub gives them: 404 with ``X-Error-Code: RepoNotFound``, ``RevisionNotFound`` or
  ``EntryNotFound``; 401/403 with ``GatedRepo`` for gated repos; and a dropped connection.

Every request is logged, so tests can assert what was (not) downloaded.

A repo may be ``hostile`` (``HOSTILE``), answering as a bad mirror or anyone on a plain-HTTP path
could: a commit id that is a path (``sha``: the ``value`` given), any revision resolved to main
(``any-revision``), ``config.json`` as an endless chunked body (``endless``) or trickled a byte at a
time (``trickle``), ``model.safetensors`` with its last 8 bytes changed (``wrong-bytes``) or listed
at 10**13 bytes (``huge``), and its download redirected to another host (``redirect``: to the URL
``value``).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

HOSTILE = ("sha", "any-revision", "endless", "trickle", "wrong-bytes", "huge", "redirect")
HUGE = 10 ** 13
LFS_SUFFIXES = (".safetensors", ".bin", ".h5", ".msgpack", ".ot", ".onnx", ".parquet", ".onnx_data")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """One repository: commits (sha -> {path: bytes}) and refs (branch or tag -> sha)."""

    repo_id: str
    kind: str = "model"  # model | dataset
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: int | None = None  # 401 or 403: refuse every request as a gated repo does without a token
    drop: bool = False  # close the connection without an answer
    hostile: str = ""  # one of HOSTILE
    value: str = ""  # the hostile commit id, or the redirect's target

    def commit(self, files: dict[str, bytes], ref: str = "main") -> str:
        """Add a commit holding ``files`` and point ``ref`` at it; returns its sha."""
        digest = hashlib.sha1(json.dumps(sorted((p, git_blob_id(d)) for p, d in files.items())).encode()
                              + str(len(self.commits)).encode()).hexdigest()
        self.commits[digest] = dict(files)
        self.refs[ref] = digest
        return digest

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        if self.hostile == "any-revision":
            return self.refs["main"]
        return self.refs.get(revision)


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by its relative POSIX path."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class FakeHub:
    """The server; use as a context manager, ``endpoint`` is its URL."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.log: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo_id: str, files: dict[str, bytes] | None = None, kind: str = "model", **options) -> Repo:
        repo = Repo(repo_id, kind, **options)
        if files is not None:
            repo.commit(files)
        self.repos[(kind, repo_id)] = repo
        return repo

    def downloads(self, repo_id: str | None = None) -> list[str]:
        """Files fetched with GET (not HEAD), as ``repo/file`` paths after ``resolve/<rev>/``."""
        fetched = []
        for method, path in self.log:
            match = re.match(r"^/(?:datasets/)?(.+?)/resolve/[^/]+/(.+)$", path)
            if method == "GET" and match and (repo_id is None or match.group(1) == repo_id):
                fetched.append(match.group(2))
        return fetched

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- the protocol ---------------------------------------------------------------------------

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def do_HEAD(self) -> None:
                self._route(head=True)

            def do_GET(self) -> None:
                self._route(head=False)

            def do_POST(self) -> None:
                self._route(head=False)

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                      head: bool = False) -> None:
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, status: int, code: str, message: str, head: bool) -> None:
                body = json.dumps({"error": message}).encode()
                self._send(status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                          "X-Error-Message": message}, head)

            def _repo(self, kind: str, repo_id: str, head: bool) -> Repo | None:
                repo = hub.repos.get((kind, repo_id))
                if repo is None:
                    self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}.", head)
                    return None
                if repo.drop:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return None
                if repo.gated:
                    self._error(repo.gated, "GatedRepo", f"Access to {kind} {repo_id} is restricted. You must "
                                "have access to it and be authenticated to access it. Please log in.", head)
                    return None
                return repo

            def _route(self, head: bool) -> None:
                url = urlparse(self.path)
                path = unquote(url.path)
                hub.log.append((self.command, path))
                api = re.match(r"^/api/(models|datasets)/(.+?)(?:/(revision|tree|paths-info)/([^/]+)(/.*)?)?$", path)
                if api:
                    kind, repo_id, what, revision, sub = api.groups()
                    self._api(kind[:-1], repo_id, what, revision or "main", (sub or "").strip("/"), head)
                    return
                resolve = re.match(r"^/(datasets/)?(.+?)/resolve/([^/]+)/(.+)$", path)
                if resolve:
                    dataset, repo_id, revision, file = resolve.groups()
                    self._resolve("dataset" if dataset else "model", repo_id, revision, file, head)
                    return
                self._error(404, "EntryNotFound", f"no route for {path}", head)

            def _commit(self, kind: str, repo_id: str, revision: str, head: bool) -> tuple[str, dict] | None:
                """The commit ``revision`` names and its files; None once a 404 has been sent."""
                repo = self._repo(kind, repo_id, head)
                if repo is None:
                    return None
                sha = repo.resolve(revision)
                if sha is None and repo.hostile == "sha" and revision == repo.value:
                    sha = repo.refs["main"]  # the hostile commit id, asked for, names the main commit
                if sha is None:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
                    return None
                return sha, repo.commits[sha]

            def _hostile(self, kind: str, repo_id: str) -> str:
                repo = hub.repos.get((kind, repo_id))
                return repo.hostile if repo is not None else ""

            def _api(self, kind: str, repo_id: str, what: str | None, revision: str, sub: str, head: bool) -> None:
                found = self._commit(kind, repo_id, revision, head)
                if found is None:
                    return
                sha, files = found
                if what == "tree":
                    prefix = f"{sub}/" if sub else ""
                    entries, folders = [], set()
                    for name in sorted(files):
                        if not name.startswith(prefix):
                            continue
                        parts = name[len(prefix):].split("/")
                        for depth in range(1, len(parts)):
                            folders.add(prefix + "/".join(parts[:depth]))
                        entries.append(self._entry(name, files[name]))
                        if name == "model.safetensors" and self._hostile(kind, repo_id) == "huge":
                            entries[-1]["size"] = entries[-1]["lfs"]["size"] = HUGE
                    entries += [{"type": "directory", "oid": git_blob_id(f.encode()), "size": 0, "path": f}
                                for f in sorted(folders)]
                    body = json.dumps(entries).encode()
                else:
                    if self._hostile(kind, repo_id) == "sha":
                        sha = hub.repos[(kind, repo_id)].value
                    info = {"id": repo_id, "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24], "sha": sha,
                            "private": False, "gated": False, "disabled": False, "downloads": 0, "likes": 0,
                            "tags": [], "lastModified": "2024-01-01T00:00:00.000Z",
                            "siblings": [{"rfilename": name} for name in sorted(files)]}
                    if kind == "dataset":
                        info["cardData"] = {}
                    body = json.dumps(info).encode()
                self._send(200, body, {"Content-Type": "application/json"}, head)

            @staticmethod
            def _entry(name: str, data: bytes) -> dict:
                entry = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": name}
                if name.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                return entry

            def _resolve(self, kind: str, repo_id: str, revision: str, file: str, head: bool) -> None:
                found = self._commit(kind, repo_id, revision, head)
                if found is None:
                    return
                sha, files = found
                data = files.get(file)
                if data is None:
                    self._error(404, "EntryNotFound", f"{file} does not exist on {revision}", head)
                    return
                hostile = self._hostile(kind, repo_id)
                if hostile in ("endless", "trickle") and file == "config.json":
                    self._endless(data, trickle=hostile == "trickle", head=head)
                    return
                target = hub.repos[(kind, repo_id)].value + self.path if hostile == "redirect" else ""
                if target and file == "model.safetensors" and self.headers.get("Host") != urlparse(target).netloc:
                    self._send(302, b"", {"Location": target}, head)
                    return
                if hostile == "wrong-bytes" and file == "model.safetensors":
                    data = data[:-8] + bytes(8)
                headers = {"X-Repo-Commit": sha, "Content-Type": "application/octet-stream",
                           "Accept-Ranges": "bytes"}
                if file.endswith(LFS_SUFFIXES):
                    etag = hashlib.sha256(data).hexdigest()
                    headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
                else:
                    etag = git_blob_id(data)
                headers["ETag"] = f'"{etag}"'
                status, body = 200, data
                ranged = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
                if ranged:
                    start = int(ranged.group(1))
                    end = int(ranged.group(2)) if ranged.group(2) else len(data) - 1
                    status, body = 206, data[start:end + 1]
                    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                headers["Content-Length"] = str(len(body))
                self._send(status, body, headers, head)

            def _endless(self, data: bytes, trickle: bool, head: bool) -> None:
                """``data``, then spaces for ever, chunked (``trickle``: a byte every half second)."""
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("ETag", f'"{git_blob_id(data)}"')
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if head:
                    return
                try:
                    if trickle:
                        for byte in data + b" " * 10_000:
                            self.wfile.write(b"1\r\n" + bytes([byte]) + b"\r\n")
                            self.wfile.flush()
                            time.sleep(0.5)
                    block = b" " * 65536
                    self.wfile.write(b"%x\r\n" % len(data) + data + b"\r\n")
                    while True:  # until the client hangs up
                        self.wfile.write(b"%x\r\n" % len(block) + block + b"\r\n")
                except OSError:
                    self.close_connection = True

        return Handler
