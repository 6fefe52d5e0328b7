"""Checkpoints as the hub and users lay them out, and the hostile inputs beside them.

* The hub's DINOv2 layout (config ``image_size`` 518, a processor that crops 224): DINOv2 and BEiT
  resample their position tables to each input's size, so any processor size of whole patches up
  to ``side_files.MAX_IMAGE_SCALE`` times image_size is theirs; ViT, DeiT and CLIP read only
  image_size. It converts exactly, and ``eval`` and ``geometry`` run through its processor.
* Many shards: more shards than the process may hold open files converts and verifies.
* The sweep: repeated tensor names in a safetensors header, a real full disk and a read-only
  parent at ``--out``, and folder names with spaces, newlines, leading dashes and unicode.
  Overlapping and out-of-file offsets, index shards outside the folder or missing, and two runs
  racing for one ``--out`` are test_hostile.py's.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from helpers import check_exact, make_hard, save, tiny_gpt2, vision_outputs
from media_models import tiny_dinov2_hub
from test_bad_input import assert_one_line_error, run_cli

from normswap.checkpoint import side_files
from normswap.checkpoint.source import CheckpointReader
from normswap.cli import main
from normswap.errors import NormswapError

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# the hub's DINOv2 layout


@pytest.fixture(scope="module")
def dinov2_hub(tmp_path_factory) -> Path:
    return tiny_dinov2_hub(tmp_path_factory.mktemp("dinov2") / "dinov2")


def test_hub_dinov2_converts_exactly_at_its_processor_size_and_its_own(dinov2_hub, tmp_path):
    """At image_size (74: the position table as stored) float64 weights match to 1e-9. At the
    processor's 32x32 the model resamples its table, and transformers resamples in float32 on
    purpose (bicubic in half precision shifts the embeddings), so float64 weights match to the
    rounding of a float32 table: 1.0e-6 measured, 1e-5 allowed. Centring commutes with resampling
    (each resampled position is a weighted sum of stored ones, the weights summing to 1)."""
    generator = torch.Generator().manual_seed(3)
    for size, fp64_tol in ((32, 1e-5), (74, 1e-9)):
        folder = tmp_path / f"at-{size}"
        folder.mkdir()
        pixels = torch.randn(2, 3, size, size, generator=generator)
        check_exact(dinov2_hub, folder, forward=vision_outputs, inputs=pixels, auto="AutoModel", fold_gains=True,
                    fp64_tol=fp64_tol)


def test_hub_dinov2_eval_and_geometry_run_through_its_processor(dinov2_hub, tmp_path, capsys):
    out = tmp_path / "rms"
    assert main(["convert", str(dinov2_hub), "--out", str(out), "--quiet"]) == 0
    code = main(["eval", str(out), "--baseline", str(dinov2_hub), "--images", "bundled", "--device", "cpu",
                 "--out", str(tmp_path / "eval")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    rows = {row["key"].split("/")[-1]: row for row in report["agreement"]}
    assert rows["min_cosine_pooled_output"]["value"] > 0.9999 and rows["max_abs_delta_pooled_output"]["ok"]
    assert main(["geometry", str(dinov2_hub), "--images", "bundled"]) == 0
    printed = capsys.readouterr().out
    # six bundled images of 16x16 patches and the class token: the processor's size, not image_size's 37x37
    assert f"over {6 * (16 * 16 + 1)} positions" in printed, printed


VISION = {"image_size": 64, "patch_size": 8}


def _processor(**values) -> dict:
    return {"image_processor_type": "BitImageProcessor", "do_resize": True, "do_center_crop": True, **values}


@pytest.mark.parametrize(("family", "values"), [
    ("dinov2", {"size": {"shortest_edge": 36}, "crop_size": {"height": 32, "width": 32}}),
    ("dinov2", {"size": {"shortest_edge": 300}, "crop_size": {"height": 512, "width": 8}}),
    ("normswap_dinov2", {"size": {"height": 16, "width": 24}, "do_center_crop": False}),
    ("beit", {"size": {"height": 96, "width": 96}, "image_processor_type": "BeitImageProcessor"}),
])
def test_families_that_resample_positions_read_any_processor_size(family, values):
    side_files.check_processor(_processor(**values), {"model_type": family, **VISION}, "p.json")


@pytest.mark.parametrize(("family", "values", "needle"), [
    ("dinov2", {"crop_size": {"height": 4, "width": 32}}, "makes 4x32 images, smaller than one 8x8 patch"),
    ("dinov2", {"size": {"shortest_edge": 7}, "do_center_crop": False}, "shorter side to 7 pixels, smaller than"),
    ("dinov2", {"crop_size": {"height": 513, "width": 32}}, "asks for 513-pixel images; the model allows at most 512"),
    ("beit", {"size": 100000, "do_center_crop": False, "image_processor_type": "BeitImageProcessor"},
     "asks for 100000-pixel images"),
    ("dinov2", {"size": 32, "do_resize": False, "do_center_crop": False}, "reads batches of one size"),
    ("vit", {"size": {"height": 32, "width": 32}, "do_center_crop": False, "image_processor_type": None},
     "makes 32x32 images, but the model reads 64x64"),
    ("deit", {"crop_size": {"height": 32, "width": 32}, "image_processor_type": None}, "makes 32x32 images, but"),
])
def test_processor_sizes_stay_bounded(family, values, needle):
    config = {"model_type": family, **VISION}
    with pytest.raises(NormswapError, match=needle):
        side_files.check_processor(_processor(**values), config, "p.json")


def test_clip_reads_only_its_image_size():
    config = {"model_type": "clip", "vision_config": {"image_size": 16, "patch_size": 8}}
    processor = {"size": {"shortest_edge": 16}, "crop_size": {"height": 24, "width": 24}, "do_center_crop": True}
    with pytest.raises(NormswapError, match="makes 24x24 images, but the model reads 16x16"):
        side_files.check_processor(copy.deepcopy(processor), config, "p.json")
    assert side_files.reads_any_image_size("normswap_beit") and not side_files.reads_any_image_size("clip")


def test_hub_dinov2_pixels_too_small_for_a_patch_are_one_line(dinov2_hub, tmp_path, capsys, monkeypatch):
    """Past the side-file check (a processor resizing only the longer side can make a sliver of
    a wide image), the pixel values themselves are held to one patch."""
    from normswap.evaluation import vision

    monkeypatch.setattr(vision, "image_processor", lambda path: lambda images, return_tensors: type(
        "Batch", (), {"pixel_values": torch.zeros(1, 3, 1, 32)})())
    code, err = run_cli(capsys, "geometry", str(dinov2_hub), "--images", "bundled")
    assert_one_line_error(code, err, "makes 3x1x32 pixel values; the model reads images from one 2x2 patch up to 592x592")


# ---------------------------------------------------------------------------------------------
# many shards

SHARDS = 1204  # a 100-layer GPT-2 holds 1,204 tensors: one per shard
OPEN_FILES = 1024  # a common default soft limit of open files


def one_tensor_per_shard(single: Path, src: Path) -> Path:
    """The checkpoint ``single`` (one model.safetensors) again at ``src``, one tensor per shard."""
    from safetensors.torch import load_file, save_file

    state = load_file(single / "model.safetensors")
    src.mkdir()
    shutil.copyfile(single / "config.json", src / "config.json")
    weight_map = {}
    for number, name in enumerate(sorted(state), 1):
        weight_map[name] = f"model-{number:05d}-of-{len(state):05d}.safetensors"
        save_file({name: state[name]}, src / weight_map[name], metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> Path:
    """A 100-layer GPT-2 (d=8) in 1,204 safetensors shards of one tensor each, with its index."""
    root = tmp_path_factory.mktemp("shards")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=100, n_embd=8, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)
    single = save(make_hard(transformers.GPT2LMHeadModel(config)), root / "single")
    src = one_tensor_per_shard(single, root / "sharded")
    assert len(list(src.glob("*.safetensors"))) == SHARDS
    return src


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def test_more_shards_than_open_files_convert_and_verify(many_shards, tmp_path):
    out = tmp_path / "out"
    process = subprocess.run(
        [sys.executable, "-m", "normswap.cli", "convert", str(many_shards), "--out", str(out), "--quiet"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=_limit_open_files, capture_output=True, text=True,
        timeout=300)
    assert process.returncode == 0, process.stderr[-2000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == SHARDS
    assert "Too many open files" not in process.stderr


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_the_reader_holds_a_bounded_pool_of_shards_open(many_shards):
    before = _open_files()
    with CheckpointReader(many_shards) as reader:
        assert _open_files() - before <= CheckpointReader.MAX_OPEN_SHARDS
        for name in reader.tensors:
            reader.get(name)
            assert _open_files() - before <= CheckpointReader.MAX_OPEN_SHARDS
    assert _open_files() == before


def test_threads_share_the_pool(many_shards, monkeypatch):
    """Eight threads reading every tensor through a pool of two: each read holds its shard open,
    whatever the others close, and every value is the stored one."""
    from safetensors.torch import load_file

    monkeypatch.setattr(CheckpointReader, "MAX_OPEN_SHARDS", 2)
    names = sorted(json.loads((many_shards / "model.safetensors.index.json").read_text())["weight_map"])[:200]
    failures = []
    with CheckpointReader(many_shards) as reader:
        expected = {name: load_file(many_shards / reader.tensors[name].shard)[name] for name in names}

        def read(offset: int) -> None:
            try:
                for name in names[offset:] + names[:offset]:
                    assert torch.equal(reader.get(name), expected[name]), name
                    assert reader.read_rows(name, 0, 1).shape[0] == 1
            except Exception as error:  # reported in the main thread
                failures.append(error)

        threads = [threading.Thread(target=read, args=(25 * index,)) for index in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(reader._recent) <= 2
    assert not failures, failures[0]


@pytest.mark.parametrize("how", ["rewritten", "replaced", "removed"])
def test_a_shard_that_changes_between_reads_is_one_line(tmp_path, monkeypatch, how):
    monkeypatch.setattr(CheckpointReader, "MAX_OPEN_SHARDS", 2)
    src = one_tensor_per_shard(tiny_gpt2(tmp_path / "single"), tmp_path / "src")
    with CheckpointReader(src) as reader:
        first, *rest = sorted(reader.tensors, key=lambda name: reader.tensors[name].shard)
        shard = src / reader.tensors[first].shard
        for name in rest[:3]:  # closes the first shard
            reader.get(name)
        data, status = shard.read_bytes(), shard.stat()
        if how == "rewritten":  # in place: the same inode and size, a later modification time
            with open(shard, "r+b") as file:
                file.seek(len(data) - 4)
                file.write(bytes(4))
            if shard.stat().st_mtime_ns == status.st_mtime_ns:  # within one tick of the clock files are stamped by
                os.utime(shard, ns=(status.st_atime_ns, status.st_mtime_ns + 1))
        elif how == "replaced":  # a copy renamed over it: same bytes, another inode
            (tmp_path / "elsewhere").write_bytes(data)
            (tmp_path / "elsewhere").rename(shard)
        else:
            shard.unlink()
        with pytest.raises(NormswapError, match="changed while it was read") as refusal:
            reader.get(first)
    assert str(shard) in str(refusal.value) and "\n" not in str(refusal.value)


# ---------------------------------------------------------------------------------------------
# the sweep: headers, full disks, read-only parents, names


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "gpt2")


@pytest.fixture(scope="module")
def reference(gpt2, tmp_path_factory) -> Path:
    """``gpt2`` converted at a plain path: the bytes every legitimate layout must give."""
    out = tmp_path_factory.mktemp("reference") / "rms"
    assert main(["convert", str(gpt2), "--out", str(out), "--quiet", "--verify", "none"]) == 0
    return out


def _raw_header(path: Path) -> tuple[str, bytes]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return raw[8: 8 + length].decode(), raw[8 + length:]


def _write_raw(path: Path, header: str, data: bytes) -> None:
    encoded = header.encode() + b" " * (-len(header) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


def _repeat_entry(header: str, same: bool) -> str:
    """The header with its first tensor's entry given twice: identical, or the second naming
    the next tensor's bytes (Python's parser keeps the last of two keys, safetensors' refuses)."""
    entries = json.loads(header)
    names = sorted((name for name in entries if name != "__metadata__"), key=lambda name: entries[name]["data_offsets"])
    first, second = names[:2]
    twin = dict(entries[first]) if same else {**entries[second]}
    return header.rstrip()[:-1] + f',{json.dumps(first)}:{json.dumps(twin)}' + "}"


@pytest.mark.parametrize("same", [True, False], ids=["identical", "another-tensor's-bytes"])
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_a_header_naming_a_tensor_twice_is_one_line(gpt2, tmp_path, capsys, command, same):
    src = tmp_path / "src"
    shutil.copytree(gpt2, src)
    header, data = _raw_header(src / "model.safetensors")
    _write_raw(src / "model.safetensors", _repeat_entry(header, same), data)
    code, err = run_cli(capsys, command, str(src), *(["--out", str(tmp_path / "out")] if command == "convert" else []))
    assert_one_line_error(code, err, "model.safetensors", "twice")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["src"]


def test_an_index_naming_a_tensor_twice_is_one_line(gpt2, tmp_path, capsys):
    src = one_tensor_per_shard(gpt2, tmp_path / "src")
    text = (src / "model.safetensors.index.json").read_text()
    first = sorted(json.loads(text)["weight_map"])[0]
    (src / "model.safetensors.index.json").write_text(
        text.replace('"weight_map": {', f'"weight_map": {{{json.dumps(first)}: "model-00002-of-{len(json.loads(text)["weight_map"]):05d}.safetensors", '))
    code, err = run_cli(capsys, "convert", str(src), "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "model.safetensors.index.json", "twice")
    assert not (tmp_path / "out").exists()


def test_an_index_naming_an_unprintable_shard_is_one_line(gpt2, tmp_path, capsys):
    src = one_tensor_per_shard(gpt2, tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = "model\udcff\n.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = run_cli(capsys, "inspect", str(src))
    assert_one_line_error(code, err, "is not a file name in the checkpoint folder")


@contextmanager
def tmpfs(folder: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted at ``folder`` (read-only when asked), unmounted after;
    the test is skipped where mounting needs a privilege this process lacks."""
    folder.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture(scope="module")
def wide_gpt2(tmp_path_factory) -> Path:
    """A GPT-2 whose converted weights take 940 kB: more than the small disks below hold."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=96, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)
    return save(make_hard(transformers.GPT2LMHeadModel(config)), tmp_path_factory.mktemp("wide") / "gpt2")


@pytest.mark.parametrize(("case", "needle"), [
    ("before-writing", "not enough disk space beside --out"),  # the free-space check sees it
    ("while-writing-weights", "no space left on the device while writing model.safetensors"),
    ("after-the-weights", "no space left on the device while writing"),  # the weights fit, the side files do not
])
def test_a_full_disk_under_out_is_one_line_and_leaves_it_empty(wide_gpt2, tmp_path, capsys, monkeypatch, case, needle):
    weights = (wide_gpt2 / "model.safetensors").stat().st_size
    # 32 KiB past the weights: room for them and the free-space check, not for the side files
    # (the README, config and modeling file take 40-60 KiB)
    size = {"after-the-weights": f"{weights // 1024 + 32}k"}.get(case, "400k")
    with tmpfs(tmp_path / "disk", size) as disk:
        if case == "while-writing-weights":  # another process fills the disk once the check has passed
            usage = shutil.disk_usage(disk)
            monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=10**12))
        code, err = run_cli(capsys, "convert", str(wide_gpt2), "--out", str(disk / "deep" / "out"), "--quiet")
        assert_one_line_error(code, err, needle, "nothing was written")
        assert list(disk.iterdir()) == [] and shutil.disk_usage(disk).used == 0


def test_a_full_tmpdir_does_not_stop_a_conversion(gpt2, reference, tmp_path, monkeypatch):
    with tmpfs(tmp_path / "tmp", "16k") as full:
        (full / "filler").write_bytes(bytes(16 << 10))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(full)}
        process = subprocess.run([sys.executable, "-m", "normswap.cli", "convert", str(gpt2), "--out",
                                  str(tmp_path / "out"), "--quiet"], env=env, capture_output=True, text=True, timeout=300)
        assert process.returncode == 0, process.stderr[-2000:]
        assert sorted(path.name for path in full.iterdir()) == ["filler"]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


@contextmanager
def read_only_folder(folder: Path) -> Iterator[Path]:
    """A folder no process may write: a read-only tmpfs where this process may mount one (root
    writes through permission bits), else a folder without write permission."""
    if os.geteuid() == 0:
        with tmpfs(folder, "64k", read_only=True):
            yield folder
        return
    folder.mkdir()
    folder.chmod(0o555)
    try:
        yield folder
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("out", ["out", "deep/out"])
def test_a_read_only_parent_of_out_is_one_line(gpt2, tmp_path, capsys, out):
    with read_only_folder(tmp_path / "locked") as locked:
        code, err = run_cli(capsys, "convert", str(gpt2), "--out", str(locked / out), "--quiet")
        assert_one_line_error(code, err, str(locked), "nothing was written")
        assert list(locked.iterdir()) == []


NAMES = {"spaces": "my model v2", "newline": "model\nnext", "leading-dash": "-model", "unicode": "modèle ✓ 模型"}


@pytest.mark.parametrize("case", list(NAMES))
def test_folder_names_convert_exactly(gpt2, reference, tmp_path, capsys, monkeypatch, case):
    """Any UTF-8 name is a folder name: as the source and as --out, relative (after ``./``, so
    that a leading dash is not an option) or absolute, the output is the reference's, byte for
    byte, and verified."""
    name = NAMES[case]
    src = tmp_path / f"{name} src"
    shutil.copytree(gpt2, src)
    monkeypatch.chdir(tmp_path)
    code = main(["convert", f"./{src.name}", "--out", f"./{name}", "--quiet"])
    assert code == 0, capsys.readouterr().err
    out = tmp_path / name
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    record = json.loads((out / "config.json").read_text())["normswap"]
    assert record["source"] == f"./{src.name}" and record["verification"]["passed"]
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("where", ["source", "out"])
def test_a_folder_name_utf8_cannot_decode_is_one_line(gpt2, tmp_path, capsys, where):
    """A name with a byte such as 0xff: normswap could read it, but transformers' safetensors
    loader cannot open it, so such a checkpoint could never be verified or loaded."""
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/model\xff"))
    if where == "source":
        shutil.copytree(gpt2, odd)
        args = ["convert", str(odd), "--out", str(tmp_path / "out")]
    else:
        args = ["convert", str(gpt2), "--out", str(odd)]
    code, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, "model\\xff is not a UTF-8 path")
    assert sorted(os.listdir(tmp_path)) == (["model\udcff"] if where == "source" else [])
