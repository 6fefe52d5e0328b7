"""Fetching a checkpoint from the Hugging Face Hub (or its local cache), with one-line errors.

The hub's answers are untrusted, as every file is: a mirror (``HF_ENDPOINT``), or anyone between
the user and a plain-HTTP endpoint, may answer anything. So the download is normswap's own, over
the hub's HTTP API, and holds to these rules:

* ``--revision`` names a branch, tag or commit: one holding ``..``, a leading ``/``, a backslash,
  a NUL or another control character is refused before any request. The revision is resolved
  first (``/api/models/{repo}/revision/{rev}``), the answer must be a commit id (40 hex
  characters), and every file is then listed and fetched by that commit id only.
* The listing (``/api/models/{repo}/tree/{commit}``) names each file's size and checksum. A file
  is fetched only when its name is a plain top-level name; it is read up to its listed size
  and no further (configuration and tokenizer files are bounded by ``bounded.MAX_BYTES`` too), and
  within a total deadline (``deadline``); the whole fetch must fit in the cache's free space.
* Each body's checksum is compared with the listing before the file enters the cache: the
  sha256 for large (LFS) files, the git blob id for the others. A body of the right length with
  other bytes is refused, and the cache keeps nothing of it.
* Every path written (``blobs/``, ``snapshots/{commit}/``, ``refs/``) is checked to lie inside the
  repository's folder of the standard hub cache (``HF_HUB_CACHE``), in the layout
  ``huggingface_hub`` reads, so ``HF_HUB_OFFLINE=1`` and the hub client use it as their own.

An unreachable hub is found out in seconds, not minutes: before any request, one TCP connection
to the endpoint (its name resolved in the same bounded wait) must open within ``CONNECT_TIMEOUT``;
when it does not, only the local cache is read, as with ``HF_HUB_OFFLINE=1``. Every request has a
read timeout (``HF_HUB_DOWNLOAD_TIMEOUT``, default 10 s) on top of the deadline.
"""

from __future__ import annotations

import fnmatch
import hashlib
import http.client
import os
import re
import shutil
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path
from urllib.parse import quote, urljoin, urlparse

from normswap.checkpoint.bounded import MAX_BYTES, parse_json
from normswap.checkpoint.names import ROTATION_FILE
from normswap.checkpoint.space import _size
from normswap.errors import NormswapError, quoted
from normswap.errors import first_line as _first_line

# What the hub's error codes mean, in the one line the user reads.
_HUB_ERRORS = {
    "RepoNotFound": "repository not found (or private: log in with `hf auth login`)",
    "GatedRepo": "the repository is gated: accept its terms on the hub and log in with `hf auth login`",
    "RevisionNotFound": "revision not found",
    "Offline": "offline mode is on (HF_HUB_OFFLINE) and it is not in the local cache",
}

# seconds for the endpoint's name to resolve and a connection to it to open
CONNECT_TIMEOUT = 2.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")
COMMIT_ID = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_ANSWER_BYTES = 16 << 20  # a repository's info or one page of its file listing
MAX_PAGES = 100  # pages of a listing (the hub pages a folder's listing by 1,000 entries)
MAX_REDIRECTS = 5
MIN_RATE = 64 << 10  # bytes per second: the slowest link the total deadline allows for
# Top-level files only (onnx/, openvino/ and the like hold other exports of the same model).
_SIDE_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken")
_BAD_NAME = re.compile(r"[/\\\x00-\x1f\x7f]")


def hub_reachable(endpoint: str, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Whether a TCP connection to ``endpoint``'s host opens within ``timeout`` seconds.

    The probe runs in a daemon thread because name resolution ignores socket timeouts: a
    resolver that hangs counts as unreachable after ``timeout`` too."""
    url = urlparse(endpoint)
    if not url.hostname:
        return False
    port = url.port or (443 if url.scheme == "https" else 80)
    opened: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, port), timeout=timeout).close()
            opened.append(True)
        except (OSError, ValueError):
            opened.append(False)

    thread = threading.Thread(target=probe, name="normswap-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(opened and opened[0])


def check_revision(revision: str | None) -> None:
    """Refuse a ``--revision`` that could name more than a branch, tag or commit: one that holds
    ``..``, starts with ``/``, or holds a backslash, a NUL or another control character."""
    if revision is None:
        return
    if (not revision or ".." in revision or revision.startswith("/") or "\\" in revision
            or re.search(r"[\x00-\x1f\x7f]", revision) or len(revision) > 255):
        raise NormswapError(f"--revision {quoted(revision)} is not a branch, tag or commit id (one holding '..', "
                            "a leading '/', a backslash or a control character is refused)")


def _bound_client_timeouts() -> None:
    """Give the hub client's default HTTP client a connect and a read timeout (a client factory the
    user installed is left alone): the datasets and lm-eval tasks a command fetches later in the
    same process go through it."""
    try:
        from huggingface_hub import set_client_factory
        from huggingface_hub.utils import _http
    except ImportError:  # older clients use requests, with their own timeouts
        return
    if getattr(_http, "_GLOBAL_CLIENT_FACTORY", None) is not getattr(_http, "default_client_factory", None):
        return
    read = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10)

    def bound(request) -> None:
        # A request made with timeout=None carries no timeouts at all; fill in the missing ones.
        timeouts = dict(request.extensions.get("timeout") or {})
        timeouts["connect"] = timeouts.get("connect") or CONNECT_TIMEOUT
        timeouts["read"] = timeouts.get("read") or read
        request.extensions["timeout"] = timeouts

    def bounded_client():
        client = _http.default_client_factory()
        client.timeout = _http.httpx2.Timeout(read, connect=CONNECT_TIMEOUT)
        client.event_hooks["request"] = [*client.event_hooks["request"], bound]
        return client

    set_client_factory(bounded_client)


def deadline(size: int) -> float:
    """Seconds one file of ``size`` bytes may take in all: three read timeouts, plus the time a
    slow link (``MIN_RATE``) takes for its bytes."""
    return 3 * _read_timeout() + size / MIN_RATE


def download(repo_id: str, *, trust_remote_code: bool, revision: str | None = None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` in the hub cache, fetched (as this
    module's docstring says) when the hub is reachable, else read from the cache."""
    check_revision(revision)
    _bound_client_timeouts()
    # README.md: the source card, whose license the converted card copies
    patterns = [*_SIDE_PATTERNS, "README.md", ROTATION_FILE] + (["*.py"] if trust_remote_code else [])
    cache = _repo_cache(repo_id)
    # Behind a proxy the endpoint itself is not dialled; the connect timeout bounds the wait.
    offline = _offline()
    if offline or (not any(os.environ.get(name) for name in _PROXY_VARIABLES) and not hub_reachable(_endpoint())):
        found = _cached_snapshot(cache, revision)
        if found is None:
            reason = _HUB_ERRORS["Offline"] if offline else f"the Hugging Face Hub is unreachable at {_endpoint()}"
            raise _fetch_error(repo_id, revision, reason)
        return found
    try:
        return _Fetch(repo_id, revision, cache).run(patterns)
    except _HubAnswer as error:
        raise _fetch_error(repo_id, revision, str(error)) from None


def _fetch_error(repo_id: str, revision: str | None, reason: str) -> NormswapError:
    at = f" at revision {quoted(revision)}" if revision else ""
    return NormswapError(f"could not fetch {quoted(repo_id)}{at} ({reason}); pass a local checkpoint directory instead")


class _HubAnswer(Exception):
    """What went wrong with one answer of the hub, in a few words."""


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows at most ``MAX_REDIRECTS`` redirects, and remembers the last one's host."""

    max_redirections = MAX_REDIRECTS

    def __init__(self) -> None:
        super().__init__()
        self.hosts: list[str] = []

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.hosts.append(urlparse(newurl).netloc)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _Fetch:
    """One repository at one revision, fetched into the hub cache."""

    def __init__(self, repo_id: str, revision: str | None, cache: Path) -> None:
        self.repo_id, self.revision, self.cache = repo_id, revision, cache
        self.endpoint = _endpoint().rstrip("/")
        self.host = urlparse(self.endpoint).netloc
        self.timeout = _read_timeout()
        self.token = _token()

    # -- the steps --------------------------------------------------------------------------------

    def run(self, patterns: list[str]) -> Path:
        ref = self.revision or "main"
        info = self._json(f"/api/models/{self.repo_id}/revision/{quote(ref, safe='')}", "the repository's info")
        commit = info.get("sha") if isinstance(info, dict) else None
        if not isinstance(commit, str) or not COMMIT_ID.match(commit):
            raise _HubAnswer(f"the hub answered {quoted(commit, 60)} as the commit of {quoted(ref)}; "
                             "a commit id is 40 hexadecimal characters")
        listing = self._listing(commit)
        wanted = self._wanted(listing, patterns + ["*.safetensors"])
        if not any(name.endswith(".safetensors") for name in wanted):
            wanted = self._wanted(listing, patterns + ["*.bin"])
        snapshot = self._inside(self.cache / "snapshots" / commit)
        missing = {name: entry for name, entry in wanted.items() if not _cached_file(snapshot / name, entry[0])}
        self._check_room(missing)
        for name, (size, kind, digest) in sorted(missing.items()):
            self._file(commit, snapshot, name, size, kind, digest)
        if ref != commit:
            refs = self._inside(self.cache / "refs" / ref)
            refs.parent.mkdir(parents=True, exist_ok=True)
            _replace_text(refs, commit)
        snapshot.mkdir(parents=True, exist_ok=True)
        return snapshot

    def _listing(self, commit: str) -> list:
        entries: list = []
        url: str | None = f"{self.endpoint}/api/models/{self.repo_id}/tree/{commit}"
        for _ in range(MAX_PAGES):
            if url is None:
                return entries
            body, headers = self._get(url, "the file listing", limit=MAX_ANSWER_BYTES)
            page = parse_json(body, "the hub's file listing", mapping=False)
            if not isinstance(page, list):
                raise _HubAnswer("the hub's file listing is not a list of files")
            entries += page
            url = _next_page(headers.get("Link", ""), url, self.host)
        raise _HubAnswer(f"the hub's file listing runs past {MAX_PAGES} pages")

    def _wanted(self, listing: list, patterns: list[str]) -> dict[str, tuple[int, str, str]]:
        """The listed top-level files matching ``patterns``: name -> (size, checksum kind, checksum)."""
        wanted = {}
        for entry in listing:
            if not isinstance(entry, dict) or entry.get("type") != "file":
                continue
            name = entry.get("path")
            if not isinstance(name, str) or not any(fnmatch.fnmatchcase(name, p) for p in patterns):
                continue
            if _BAD_NAME.search(name) or name in (".", ".."):
                continue  # a folder's file (or no file name): not a top-level file
            size, lfs = entry.get("size"), entry.get("lfs")
            if not _natural(size):
                raise _HubAnswer(f"the hub lists {quoted(name)} with the size {quoted(size, 40)}")
            if isinstance(lfs, dict) and isinstance(lfs.get("oid"), str) and _SHA256.match(lfs["oid"]):
                if lfs.get("size", size) != size:
                    raise _HubAnswer(f"the hub lists two sizes for {quoted(name)}")
                wanted[name] = (size, "sha256", lfs["oid"])
            elif isinstance(entry.get("oid"), str) and COMMIT_ID.match(entry["oid"]):
                if size > MAX_BYTES:
                    raise _HubAnswer(f"the hub lists {quoted(name)} at {size:,} bytes, more than the "
                                     f"{MAX_BYTES >> 20} MiB any configuration or tokenizer file may hold")
                wanted[name] = (size, "git", entry["oid"])
            else:
                raise _HubAnswer(f"the hub lists {quoted(name)} without a checksum (an lfs sha256 or a git blob id)")
        return wanted

    def _check_room(self, missing: dict[str, tuple[int, str, str]]) -> None:

        needed = sum(size for size, _, _ in missing.values())
        folder = next(p for p in (self.cache, *self.cache.parents) if p.exists())
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            return
        if needed > free:
            largest = max(missing, key=lambda name: missing[name][0])
            raise _HubAnswer(f"the hub lists {_size(needed)} of files ({largest}: {missing[largest][0]:,} bytes), "
                             f"more than the {_size(free)} free in the hub cache {folder}")

    def _file(self, commit: str, snapshot: Path, name: str, size: int, kind: str, digest: str) -> None:
        blob = self._inside(self.cache / "blobs" / digest)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not _cached_file(blob, size):
            partial = self._inside(blob.with_name(f"{digest}.incomplete-{os.getpid()}"))
            hasher = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % size)
            url = f"{self.endpoint}/{self.repo_id}/resolve/{commit}/{quote(name)}"
            bar = _bar(name, size)
            try:
                with open(partial, "wb") as sink:
                    def write(chunk: bytes) -> None:
                        hasher.update(chunk)
                        sink.write(chunk)
                        if bar is not None:
                            bar.update(len(chunk))

                    self._get(url, name, limit=size, exact=True, sink=write)
                if hasher.hexdigest() != digest:
                    raise _HubAnswer(f"the hub sent {name} with other bytes than the listing's "
                                     f"{'sha256' if kind == 'sha256' else 'git blob id'} {digest}")
                os.replace(partial, blob)
            finally:
                partial.unlink(missing_ok=True)
                if bar is not None:
                    bar.close()
        link = self._inside(snapshot / name)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        try:
            link.symlink_to(os.path.relpath(blob, link.parent))
        except OSError:  # a filesystem without links: the snapshot holds a copy
            shutil.copyfile(blob, link)

    # -- HTTP -------------------------------------------------------------------------------------

    def _json(self, path: str, what: str):
        body, _ = self._get(self.endpoint + path, what, limit=MAX_ANSWER_BYTES)
        return parse_json(body, f"the hub's answer for {what}", mapping=False)

    def _get(self, url: str, what: str, *, limit: int, exact: bool = False, sink=None) -> tuple[bytes, Message]:
        """The body of ``url`` (or its bytes handed to ``sink``), at most ``limit`` bytes (with
        ``exact``: exactly), within ``deadline(limit)`` seconds."""
        request = urllib.request.Request(url, headers={"User-Agent": "normswap", "Accept-Encoding": "identity"})
        if self.token:  # never sent on to a host the hub redirects to
            request.add_unredirected_header("Authorization", f"Bearer {self.token}")
        redirects = _Redirects()
        opener = urllib.request.build_opener(redirects)
        stop = time.monotonic() + deadline(limit)
        chunks: list[bytes] = []
        received = 0
        try:
            with opener.open(request, timeout=self.timeout) as answer:
                length = answer.headers.get("Content-Length")
                if exact and length is not None and length.strip() != str(limit):
                    raise _HubAnswer(f"the hub sent {quoted(length, 40)} bytes of {what}, which the listing gives "
                                     f"at {limit:,}")
                while True:
                    chunk = answer.read1(1 << 20)
                    if not chunk:
                        break
                    received += len(chunk)
                    if received > limit:
                        raise _HubAnswer(f"the hub sent more than the {limit:,} bytes of {what}"
                                         f"{' its listing gives' if exact else ' any such answer holds'}")
                    if sink is None:
                        chunks.append(chunk)
                    else:
                        sink(chunk)
                    if time.monotonic() > stop:
                        raise _HubAnswer(f"the hub took more than {deadline(limit):.0f} s to send {what} "
                                         f"({received:,} of {limit:,} bytes arrived)")
                if exact and received != limit:
                    raise _HubAnswer(f"the hub sent {received:,} bytes of {what}, which the listing gives at {limit:,}")
                return b"".join(chunks), answer.headers
        except urllib.error.HTTPError as error:
            raise _HubAnswer(self._refusal(error, what)) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
            raise _HubAnswer(self._failure(error, what, redirects.hosts)) from None

    def _refusal(self, error: urllib.error.HTTPError, what: str) -> str:
        code = error.headers.get("X-Error-Code", "") if error.headers else ""
        if code in _HUB_ERRORS:
            return _HUB_ERRORS[code]
        if error.code in (401, 403):
            return _HUB_ERRORS["GatedRepo"]
        if error.code == 404:
            return f"{what} not found"
        if 300 <= error.code < 400:
            return f"the hub redirected {what} more than {MAX_REDIRECTS} times"
        return f"the hub answered HTTP {error.code} for {what}"

    def _failure(self, error: BaseException, what: str, hosts: list[str]) -> str:
        reason = getattr(error, "reason", None) or error
        words = (_first_line(reason) if not isinstance(reason, str) else reason)[:120]
        if isinstance(reason, TimeoutError) or isinstance(error, TimeoutError):
            words = f"nothing arrived for {self.timeout:g} s"
        elif isinstance(error, (http.client.RemoteDisconnected, http.client.IncompleteRead, ConnectionResetError)):
            words = "the connection closed before the answer was complete"
        if hosts and hosts[-1] != self.host:
            return f"the hub redirected {what} to another host, {quoted(hosts[-1], 80)}, which failed: {words}"
        if isinstance(reason, (ConnectionRefusedError, socket.gaierror)):
            return f"the Hugging Face Hub is unreachable at {self.endpoint} ({words})"
        return f"the hub at {self.endpoint} failed while sending {what}: {words}"

    def _inside(self, path: Path) -> Path:
        """``path``, once it is known to lie inside this repository's cache folder."""
        base = self.cache.resolve()
        resolved = path.resolve()
        if resolved != base and base not in resolved.parents:
            raise _HubAnswer(f"the hub's answers lead out of the cache, to {quoted(str(path), 120)}")
        return path


def _next_page(link: str, url: str, host: str) -> str | None:
    """The ``rel="next"`` page of a ``Link`` header, on the same host only."""
    match = re.search(r'<([^>]+)>\s*;\s*rel="next"', link)
    if not match:
        return None
    following = urljoin(url, match.group(1))
    if urlparse(following).netloc != host:
        raise _HubAnswer(f"the hub's file listing continues on another host, {quoted(urlparse(following).netloc)}")
    return following


def _cached_snapshot(cache: Path, revision: str | None) -> Path | None:
    """The cached snapshot ``revision`` names (a commit id, or a ref the cache records), if any."""
    ref = revision or "main"
    commit = ref if COMMIT_ID.match(ref) else None
    if commit is None:
        refs = cache / "refs" / ref
        try:
            if refs.resolve().is_relative_to(cache.resolve()) and refs.is_file():
                with open(refs, "rb") as handle:
                    text = handle.read(100).decode("ascii", "replace").strip()
                commit = text if COMMIT_ID.match(text) else None
        except OSError:
            return None
    snapshot = cache / "snapshots" / commit if commit else None
    if snapshot is None or not (snapshot / "config.json").exists():
        return None
    return snapshot


def _cached_file(path: Path, size: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size == size
    except OSError:
        return False


def _replace_text(path: Path, text: str) -> None:
    partial = path.with_name(f"{path.name}.incomplete-{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _repo_cache(repo_id: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))


def _token() -> str | None:
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # no token store, or one the client cannot read: fetch anonymously
        return None


def _read_timeout() -> float:
    try:
        return max(0.1, float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT") or 10))
    except ValueError:
        return 10.0


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _bar(name: str, size: int):
    """A bar for a large file's download, only when stderr is a terminal and no switch
    (``--no-progress``, ``HF_HUB_DISABLE_PROGRESS_BARS``, ``TQDM_DISABLE``) turned bars off."""
    switches = ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")
    if size < (16 << 20) or not sys.stderr.isatty() or any(
            os.environ.get(switch, "").strip().lower() in ("1", "true", "yes", "on") for switch in switches):
        return None
    from tqdm import tqdm

    return tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"fetching {name}", delay=1.0,
                leave=False, dynamic_ncols=True)
