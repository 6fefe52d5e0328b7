"""Kills during an install, and a closed output pipe: one line, and nothing left that a later run
cannot clean (the interrupting signals are tested in test_hostile.py). The commands run in
subprocesses: a kill needs a process of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_gpt2

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each case starts a fresh interpreter


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return tiny_gpt2(tmp_path_factory.mktemp("kills") / "gpt2")


def run_script(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_a_closed_output_pipe_is_one_line():
    read, write = os.pipe()
    os.close(read)
    try:
        process = subprocess.run([sys.executable, "-m", "normswap.cli", "inspect", "normswap:austen-gpt2"],
                                 stdout=write, stderr=subprocess.PIPE, text=True, timeout=300,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    lines = [line for line in process.stderr.splitlines() if line.strip()]
    assert process.returncode != 0 and len(lines) == 1 and "Broken pipe" in lines[0], process.stderr


# A process that installs a small output through ``claimed_output`` and is killed (SIGKILL) just
# before the k-th rename or unlink of the install (k = 0: never); it prints how many there were.
INSTALL = """
import os, signal, sys
from pathlib import Path
from normswap.checkpoint import output, renames
kill_at, out, overwrite, content = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
steps, installing = 0, False
def counted(call):
    def step(*args, **kwargs):
        global steps
        if installing:
            steps += 1
            if steps == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return call(*args, **kwargs)
    return step
for name in ("rename", "replace", "unlink", "rmdir"):
    setattr(os, name, counted(getattr(os, name)))
renames._renameat2 = counted(renames._renameat2)
install = output.Claim.install
def installed(self):
    global installing
    installing = True
    install(self)
output.Claim.install = installed
with output.claimed_output(out, inputs=[], overwrite=overwrite, kind="checkpoint") as claim:
    for name in ("config.json", "model.safetensors", "README.md"):
        (claim.tmp / name).write_text(content)
    (claim.tmp / "sub").mkdir()
    (claim.tmp / "sub" / "tokenizer.json").write_text(content)
    claim.install()
print(steps)
"""


def install(kill_at: int, out: Path, overwrite: bool, content: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", INSTALL, str(kill_at), str(out), "1" if overwrite else "0", content],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)


def whole(out: Path, content: str) -> bool:
    from normswap.checkpoint import journal, marker, temporaries

    return (marker.marked_kind(out) == "checkpoint" and not marker.foreign_paths(out)
            and not (out / journal.JOURNAL).exists() and not (out / temporaries.TMP_MARKER).exists()
            and all((out / name).read_text() == content for name in ("config.json", "model.safetensors", "README.md",
                                                                     "sub/tokenizer.json")))


@pytest.mark.parametrize("case", ["empty folder of the user", "overwrite"])
def test_a_kill_at_any_step_of_the_install_is_repaired_by_the_next_run(tmp_path, case):
    """SIGKILL before each rename and unlink of an install: the next run for the same --out
    finishes or takes back what was cut short, removes the temporary folder, and installs whole;
    the user's empty folder is kept (the same inode), an old output is replaced only by a new one."""
    from normswap.checkpoint import output

    overwrite = case == "overwrite"
    counting = tmp_path / "count" / "out"
    counting.parent.mkdir()
    if overwrite:
        assert install(0, counting, False, "old").returncode == 0
    else:
        counting.mkdir()
    steps = int(install(0, counting, overwrite, "new").stdout)
    assert steps >= 3
    for kill_at in range(1, steps + 1):
        parent = tmp_path / f"kill-{kill_at}"
        out = parent / "out"
        parent.mkdir()
        if overwrite:
            assert install(0, out, False, "old").returncode == 0
        else:
            out.mkdir()
        inode = out.stat().st_ino
        killed = install(kill_at, out, overwrite, "new")
        assert killed.returncode == -9, (kill_at, killed.stderr)
        messages: list[str] = []
        try:
            with output.claimed_output(out, inputs=[], overwrite=overwrite, kind="checkpoint",
                                       log=messages.append) as claim:
                for name in ("config.json", "model.safetensors", "README.md"):
                    (claim.tmp / name).write_text("new")
                (claim.tmp / "sub").mkdir()
                (claim.tmp / "sub" / "tokenizer.json").write_text("new")
                claim.install()
        except Exception as error:  # the killed install had completed: a whole output is there already
            assert not overwrite and "not empty; pass --overwrite" in str(error), (kill_at, error)
        assert whole(out, "new"), (kill_at, messages, sorted(p.name for p in out.iterdir()))
        assert sorted(p.name for p in parent.iterdir()) == ["out"], (kill_at, messages)
        if not overwrite:
            assert out.stat().st_ino == inode


def test_a_convert_killed_at_its_third_rename_into_the_users_folder_is_repaired(source, tmp_path):
    """The case of ``strace -e inject=renameat2:signal=SIGKILL:when=3``: a user's empty --out,
    half filled when the kill lands; the next plain run takes that half back and installs whole."""
    from normswap.checkpoint.marker import foreign_paths, marked_kind
    from normswap.cli import main

    out = tmp_path / "o-mine"
    out.mkdir()
    script = INSTALL.split("with output.claimed_output")[0].replace(
        "kill_at, out, overwrite, content = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == \"1\", sys.argv[4]",
        f"kill_at = 3\nsource, out = {str(source)!r}, {str(out)!r}")
    script += "from normswap.cli import main\nmain(['convert', source, '--out', out, '--verify', 'none', '--quiet'])\n"
    killed = run_script(script)
    assert killed.returncode == -9, killed.stderr
    assert any(out.iterdir())  # cut short: some of the output is in the user's folder
    assert main(["convert", str(source), "--out", str(out), "--verify", "none", "--quiet"]) == 0
    assert marked_kind(out) == "checkpoint" and not foreign_paths(out)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["o-mine"]
