"""Fetching a checkpoint from the Hugging Face Hub (or its local cache), with one-line errors.

An unreachable hub is found out in seconds, not minutes: before any request, one TCP connection
to the endpoint (its name resolved in the same bounded wait) must open within ``CONNECT_TIMEOUT``;
when it does not, only the local cache is read, as with ``HF_HUB_OFFLINE=1``. The hub client's
own requests get the same connect timeout and a read timeout (``HF_HUB_ETAG_TIMEOUT``, default
10 s), where its default is to wait for ever on a server that accepts and never answers.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from normswap.errors import NormswapError
from normswap.errors import first_line as _first_line

# What the hub client's errors mean, by class name, in the one line the user reads.
_HUB_ERRORS = {
    "RepositoryNotFoundError": "repository not found (or private: log in with `hf auth login`)",
    "GatedRepoError": "the repository is gated: accept its terms on the hub and log in with `hf auth login`",
    "RevisionNotFoundError": "revision not found",
    "OfflineModeIsEnabled": "offline mode is on (HF_HUB_OFFLINE) and it is not in the local cache",
}


# seconds for the endpoint's name to resolve and a connection to it to open
CONNECT_TIMEOUT = 2.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")


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


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _bound_client_timeouts() -> None:
    """Give the hub client's default HTTP client a connect and a read timeout (a client factory the
    user installed is left alone)."""
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


def download(repo_id: str, *, trust_remote_code: bool, revision: str | None = None) -> Path:
    import logging

    from huggingface_hub import snapshot_download

    # The hub client logs every retry; one line from us says it all.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    _bound_client_timeouts()
    patterns = ["*.json", "*.txt", "*.model", "*.tiktoken"] + (["*.py"] if trust_remote_code else [])
    # Top-level files only: onnx/, openvino/ and the like hold other exports of the same model.
    options = {"revision": revision, "ignore_patterns": ["*/*"]}
    # Behind a proxy the endpoint itself is not dialled; the client's connect timeout bounds the wait.
    if not _offline() and not any(os.environ.get(name) for name in _PROXY_VARIABLES):
        options["local_files_only"] = not hub_reachable(_endpoint())
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=patterns + ["*.safetensors"], **options))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id, allow_patterns=patterns + ["*.bin"], **options))
        return path
    except Exception as error:  # the hub client raises many types; all mean "could not fetch"
        raise NormswapError(
            f"could not fetch '{repo_id}'{f' at revision {revision}' if revision else ''} ({_hub_reason(error)}); "
            "pass a local checkpoint directory instead"
        ) from None


def _hub_reason(error: BaseException) -> str:
    """The cause of a failed download, in a few words."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and len(chain) < 8:
        chain.append(current)
        current = current.__cause__ or current.__context__
    names = [type(e).__name__ for e in chain]
    if "OfflineModeIsEnabled" in names or any("offline" in _first_line(e).lower() for e in chain[:1]):
        return _HUB_ERRORS["OfflineModeIsEnabled"]
    for name in names:
        if name in _HUB_ERRORS:
            return _HUB_ERRORS[name]
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status in (401, 403):
        return _HUB_ERRORS["GatedRepoError"]
    reason = _first_line(error)
    connection = ("ConnectError", "ConnectionError", "RemoteProtocolError", "ReadError", "TimeoutException",
                  "ConnectTimeout", "ReadTimeout", "LocalEntryNotFoundError")
    if any(name in connection for name in names) or "Name or service not known" in reason or "connect" in reason.lower():
        return f"the Hugging Face Hub is unreachable at {_endpoint()}"
    sentence = reason.split(". ")[0].rstrip(".")
    if len(sentence) > 160:  # the client's messages run to paragraphs; cut at a word
        sentence = sentence[:160].rsplit(" ", 1)[0] + " ..."
    return sentence


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")
