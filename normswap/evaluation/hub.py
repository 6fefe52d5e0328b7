"""Is the Hugging Face hub reachable? Checked once, quickly, before anything slow starts.

Without this check an offline run of a hub task spends a long time in retries and then dies with a
traceback from deep inside ``datasets``; with it, the user gets one line up front.
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse

from normswap.errors import NormswapError

_TRUTHY = {"1", "true", "yes", "on"}


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the hub endpoint accepts a TCP connection and offline mode is not forced."""
    if any(os.environ.get(name, "").lower() in _TRUTHY for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require_hub(what: str) -> None:
    """Raise a one-line ``NormswapError`` naming ``what`` when the hub cannot be reached."""
    if not hub_reachable():
        raise NormswapError(
            f"{what} needs the Hugging Face hub, which is unreachable (offline?); "
            "use local text (--text) and local tasks (normswap/evals/), or run online"
        )
