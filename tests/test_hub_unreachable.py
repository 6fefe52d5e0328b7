"""An unreachable hub is found out in seconds, and the local cache still serves what it holds.

The commands run in a subprocess, as in tests/test_hub.py, because ``huggingface_hub`` reads its
endpoint at import. The bounds below are generous limits on waits that would otherwise last for
ever (a silent server) or tens of seconds (retries), not speed measurements.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hubserver import FakeHub
from test_hub import gpt2_like_repo, normswap_cli, one_line

from normswap.checkpoint import hub


def test_the_probe_gives_up_on_a_resolver_or_connect_that_hangs(monkeypatch):
    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(socket, "create_connection", hang)
    start = time.monotonic()
    try:
        assert hub.hub_reachable("https://huggingface.co", timeout=0.2) is False
        assert time.monotonic() - start < 5
    finally:
        release.set()  # the probe thread ends here, inside this test


def test_the_probe_sees_a_listening_server_and_a_closed_port():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        assert hub.hub_reachable(f"http://127.0.0.1:{listening.getsockname()[1]}") is True
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert hub.hub_reachable(f"http://127.0.0.1:{port}") is False
    assert hub.hub_reachable("not a url") is False


@pytest.mark.slow
def test_unreachable_hub_is_one_line_and_the_cache_still_serves(tmp_path):
    home = tmp_path / "hf"
    with FakeHub() as server:
        server.add("gpt2", gpt2_like_repo())
        fetched = normswap_cli("inspect", "gpt2", hub=server, home=home, cwd=tmp_path)
        assert fetched.returncode == 0, fetched.stderr
        endpoint = server.endpoint
    # the same endpoint, now closed: what the cache holds is read from it, as HF_HUB_OFFLINE=1 would
    cached = normswap_cli("inspect", "gpt2", hub=None, home=home, cwd=tmp_path, endpoint=endpoint)
    assert cached.returncode == 0, cached.stderr
    missing = normswap_cli("convert", "some-org/not-cached", "--out", "x", hub=None, home=home, cwd=tmp_path,
                           endpoint=endpoint)
    one_line(missing, "could not fetch 'some-org/not-cached'", "unreachable")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_a_server_that_never_answers_times_out(tmp_path):
    """A hub that accepts connections and never replies: the client's requests carry a read
    timeout (HF_HUB_DOWNLOAD_TIMEOUT, 5 s in these tests) instead of waiting for ever."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        start = time.monotonic()
        result = normswap_cli("convert", "gpt2", "--out", "x", hub=None, home=tmp_path / "hf", cwd=tmp_path,
                              endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}")
        elapsed = time.monotonic() - start
    one_line(result, "could not fetch 'gpt2'", "nothing arrived for 5 s")
    assert elapsed < 120, elapsed  # without the read timeout this run never ends
