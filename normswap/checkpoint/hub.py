"""Fetching a checkpoint from the Hugging Face Hub (or its local cache), with one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

from normswap.errors import NormswapError
from normswap.errors import first_line as _first_line

# What the hub client's errors mean, by class name, in the one line the user reads.
_HUB_ERRORS = {
    "RepositoryNotFoundError": "repository not found (or private: log in with `hf auth login`)",
    "GatedRepoError": "the repository is gated: accept its terms on the hub and log in with `hf auth login`",
    "RevisionNotFoundError": "revision not found",
    "OfflineModeIsEnabled": "offline mode is on (HF_HUB_OFFLINE) and it is not in the local cache",
}


def download(repo_id: str, *, trust_remote_code: bool, revision: str | None = None) -> Path:
    import logging

    from huggingface_hub import snapshot_download

    # The hub client logs every retry; one line from us says it all.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    patterns = ["*.json", "*.txt", "*.model", "*.tiktoken"] + (["*.py"] if trust_remote_code else [])
    # Top-level files only: onnx/, openvino/ and the like hold other exports of the same model.
    options = {"revision": revision, "ignore_patterns": ["*/*"]}
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
