"""A hostile hub: every answer of the stand-in hub's ``hostile`` modes (``hubserver.HOSTILE``) is
refused in one line, and nothing outside the hub cache is written, nor anything unchecked inside it.

The commands run in a subprocess, as in tests/test_hub.py, because ``huggingface_hub`` reads its
endpoint at import. The bounds on elapsed time are generous limits on waits that would otherwise
last for ever, not speed measurements.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from hubserver import HUGE, FakeHub
from test_hub import gpt2_like_repo, normswap_cli, one_line

from normswap.checkpoint.hub import check_revision
from normswap.errors import NormswapError

pytestmark = pytest.mark.slow  # each case starts the CLI in a fresh interpreter


@pytest.fixture(scope="module")
def files():
    return gpt2_like_repo()


def files_outside(root: Path, home: Path) -> dict[str, bytes]:
    """Every file under ``root`` but the hub cache ``home``, with its bytes."""
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and home not in p.parents}


def convert(repo: str, hub: FakeHub, tmp_path: Path, *extra: str, **options):
    return normswap_cli("convert", repo, "--out", "out", "--verify", "none", *extra, hub=hub,
                        home=tmp_path / "work" / "hf", cwd=tmp_path / "work", **options)


@pytest.fixture
def victim(tmp_path):
    (tmp_path / "work").mkdir()
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "notes.json").write_text("the user's notes\n")
    return folder


@pytest.mark.parametrize("sha", ["../../../../../victim/notes", "/{victim}/abs", "ABCDEF" * 7])
def test_a_commit_id_that_is_a_path_is_refused_and_writes_nothing(files, tmp_path, victim, sha):
    sha = sha.format(victim=str(victim).lstrip("/"))
    before = files_outside(tmp_path, tmp_path / "work" / "hf")
    with FakeHub() as hub:
        hub.add("org/model", files, hostile="sha", value=sha)
        result = convert("org/model", hub, tmp_path)
    one_line(result, "could not fetch 'org/model'", "a commit id is 40 hexadecimal characters")
    assert files_outside(tmp_path, tmp_path / "work" / "hf") == before
    assert not (tmp_path / "work" / "out").exists()


@pytest.mark.parametrize("revision", ["{victim}/notes.json", "../../../../../victim/revfile", "main\\..x", "a..b"])
def test_a_revision_that_could_be_a_path_is_refused_before_any_request(files, tmp_path, victim, revision):
    revision = revision.format(victim=victim)
    before = files_outside(tmp_path, tmp_path / "work" / "hf")
    with FakeHub() as hub:
        hub.add("org/model", files, hostile="any-revision")
        result = convert("org/model", hub, tmp_path, "--revision", revision)
        requests = list(hub.log)
    one_line(result, "--revision", "is not a branch, tag or commit id")
    assert requests == []
    assert files_outside(tmp_path, tmp_path / "work" / "hf") == before


def test_check_revision_refuses_nul_and_control_characters():
    for revision in ("main\0", "ma\nin", "", "/main"):
        with pytest.raises(NormswapError, match="not a branch, tag or commit id"):
            check_revision(revision)
    for revision in ("main", "v1.0", "refs/pr/1", "a" * 40):
        check_revision(revision)


def test_an_endless_body_stops_at_the_listed_size(files, tmp_path):
    (tmp_path / "work").mkdir()
    with FakeHub() as hub:
        hub.add("org/model", files, hostile="endless")
        start = time.monotonic()
        result = convert("org/model", hub, tmp_path)
    one_line(result, "could not fetch 'org/model'", f"more than the {len(files['config.json']):,} bytes of config.json")
    assert time.monotonic() - start < 120
    assert not list((tmp_path / "work" / "hf").rglob("config.json"))


def test_a_trickled_body_ends_at_its_deadline(files, tmp_path):
    (tmp_path / "work").mkdir()
    with FakeHub() as hub:
        hub.add("org/model", files, hostile="trickle")
        start = time.monotonic()
        result = convert("org/model", hub, tmp_path, env={"HF_HUB_DOWNLOAD_TIMEOUT": "1"})
        elapsed = time.monotonic() - start
    one_line(result, "could not fetch 'org/model'", "the hub took more than 3 s to send config.json")
    assert elapsed < 60, elapsed  # a byte every half second: 827 bytes would take minutes


def test_the_right_length_with_other_bytes_is_refused_and_not_cached(files, tmp_path):
    (tmp_path / "work").mkdir()
    with FakeHub() as hub:
        hub.add("org/model", files, hostile="wrong-bytes")
        result = convert("org/model", hub, tmp_path)
    true_sha256 = hashlib.sha256(files["model.safetensors"]).hexdigest()
    one_line(result, "could not fetch 'org/model'", f"model.safetensors with other bytes than the listing's sha256 "
             f"{true_sha256}")
    blobs = tmp_path / "work" / "hf" / "hub" / "models--org--model" / "blobs"
    assert not (blobs / true_sha256).exists() and not [p for p in blobs.iterdir() if "incomplete" in p.name]


def test_a_huge_listed_size_is_named_and_nothing_is_fetched(files, tmp_path):
    (tmp_path / "work").mkdir()
    with FakeHub() as hub:
        hub.add("org/model", files, hostile="huge")
        # bars are not turned off in the environment: stderr is not a terminal, so none is drawn
        result = convert("org/model", hub, tmp_path, env={"HF_HUB_DISABLE_PROGRESS_BARS": None})
        fetched = hub.downloads()
    line = one_line(result, "could not fetch 'org/model'", f"model.safetensors: {HUGE:,} bytes", "free in the hub cache")
    assert "unreachable" not in line
    assert fetched == []


def test_a_redirect_to_another_host_is_followed_and_its_failure_named(files, tmp_path):
    (tmp_path / "work").mkdir()
    with FakeHub() as hub:
        # the hub's large files live on other hosts (a CDN): a redirect there is followed
        hub.add("org/model", files, hostile="redirect", value=hub.endpoint.replace("127.0.0.1", "localhost"))
        hub.add("org/gone", files, hostile="redirect", value="http://localhost:9")
        followed = convert("org/model", hub, tmp_path)
        failed = normswap_cli("convert", "org/gone", "--out", "out2", hub=hub, home=tmp_path / "work" / "hf",
                              cwd=tmp_path / "work")
    assert followed.returncode == 0, followed.stderr
    line = one_line(failed, "could not fetch 'org/gone'", "redirected model.safetensors to another host, 'localhost:9'")
    assert "unreachable at" not in line


def test_a_cache_folder_linked_out_of_the_cache_is_not_written_through(files, tmp_path, victim):
    """Every path the client writes must lie inside the repository's cache folder, links resolved."""
    blobs = tmp_path / "work" / "hf" / "hub" / "models--org--model" / "blobs"
    blobs.parent.mkdir(parents=True)
    blobs.symlink_to(victim)
    before = files_outside(tmp_path, tmp_path / "work" / "hf")
    with FakeHub() as hub:
        hub.add("org/model", files)
        result = convert("org/model", hub, tmp_path)
    one_line(result, "could not fetch 'org/model'", "lead out of the cache")
    assert files_outside(tmp_path, tmp_path / "work" / "hf") == before
