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
from pathlib import Path

import pytest
import torch
from helpers import check_exact, vision_outputs
from media_models import tiny_dinov2_hub
from test_bad_input import assert_one_line_error, run_cli

from normswap.checkpoint import side_files
from normswap.cli import main
from normswap.errors import NormswapError

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
