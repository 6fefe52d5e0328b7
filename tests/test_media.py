"""Speech (Whisper) and vision (ViT, CLIP): ``eval`` and ``geometry`` on audio and images.

Tiny random checkpoints with their own processors (``media_models``) are converted once per
module; the commands then run on the bundled speech and images through the command line, and every
bad input gives one line.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile
import transformers as T
from media_models import tiny_clip, tiny_image_model, tiny_vit, tiny_whisper
from test_bad_input import assert_one_line_error, run_cli

import normswap
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.evaluation import audio as audio_mod
from normswap.evaluation import media
from normswap.evaluation.speech import word_error_rate

BUNDLED_SPEECH = media._data_dir("speech")
BUNDLED_IMAGES = media._data_dir("images")


def _tiny_dinov2(path):
    """A DINOv2 backbone (no head) on 16×16 images."""
    return tiny_image_model(path, T.Dinov2Model, T.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                                image_size=16, patch_size=8, layerscale_value=0.3))


class _Converted(dict):
    """family -> (source, converted) folders, each built and converted once, on first use."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> tuple:
        build = {"whisper": tiny_whisper, "vit": tiny_vit, "clip": tiny_clip, "dinov2": _tiny_dinov2}[family]
        src = build(self.root / family)
        normswap.convert_checkpoint(src, self.root / f"{family}-rms", quiet=True)
        self[family] = (src, self.root / f"{family}-rms")
        return self[family]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Converted(tmp_path_factory.mktemp("media"))


@pytest.fixture(scope="module")
def two_utterances(tmp_path_factory):
    """Two of the bundled utterances: enough for the commands, quicker than all six."""
    folder = tmp_path_factory.mktemp("speech")
    for stem in ("sense-01", "emma-01"):
        for suffix in (".flac", ".txt"):
            shutil.copy(BUNDLED_SPEECH / f"{stem}{suffix}", folder)
    return folder


# ---------------------------------------------------------------------------------------------
# reading inputs


def test_bundled_speech_is_small_16k_and_transcribed():
    total = sum(p.stat().st_size for p in BUNDLED_SPEECH.iterdir())
    assert total < 1_000_000
    audio = audio_mod.read_audio(audio_mod.BUNDLED, 16_000)
    assert len(audio.utterances) >= 5
    assert all(u.rate == 16_000 and 2 < u.seconds < 10 and u.text for u in audio.utterances)
    assert soundfile.info(str(BUNDLED_SPEECH / "sense-01.flac")).samplerate == 16_000


def test_audio_is_resampled_and_mixed_to_mono(tmp_path):
    stereo = np.stack([np.sin(np.linspace(0, 100, 8000)), np.zeros(8000)], axis=1).astype("float32")
    soundfile.write(tmp_path / "a.wav", stereo, 8000)
    (tmp_path / "a.txt").write_text("hello there\n")
    audio = audio_mod.read_audio(str(tmp_path), 16_000)
    [utterance] = audio.utterances
    assert utterance.audio.ndim == 1 and abs(len(utterance.audio) - 16_000) <= 1
    assert utterance.text == "hello there"


def test_manifest(tmp_path):
    shutil.copy(BUNDLED_SPEECH / "sense-01.flac", tmp_path / "x.flac")
    (tmp_path / "m.jsonl").write_text(json.dumps({"audio": "x.flac", "text": "The family of Dashwood."}) + "\n\n")
    audio = audio_mod.read_audio(str(tmp_path / "m.jsonl"), 16_000)
    assert [u.text for u in audio.utterances] == ["The family of Dashwood."]


@pytest.mark.parametrize("case, needle", [
    ("missing", "audio path not found"),
    ("empty", "no audio files"),
    ("no-transcript", "transcript missing"),
    ("unreadable", "cannot read audio file"),
    ("bad-json", "line 1: not valid JSON"),
    ("deep-json", "line 1: nested more than"),
    ("manifest-missing-file", "audio file not found"),
    ("manifest-no-text", '"audio" and "text"'),
])
def test_audio_errors(tmp_path, case, needle):
    spec = tmp_path / "audio"
    spec.mkdir()
    if case == "missing":
        spec = tmp_path / "nowhere"
    elif case == "no-transcript":
        shutil.copy(BUNDLED_SPEECH / "sense-01.flac", spec)
    elif case == "unreadable":
        (spec / "broken.wav").write_bytes(b"RIFF not really a wave file")
        (spec / "broken.txt").write_text("words")
    elif case.startswith(("bad-json", "deep-json", "manifest")):
        spec = tmp_path / "m.jsonl"
        line = {"bad-json": "{nope", "deep-json": "[" * 5000 + "]" * 5000, "manifest-missing-file": json.dumps({"audio": "gone.wav", "text": "t"}),
                "manifest-no-text": json.dumps({"audio": "gone.wav"})}[case]
        spec.write_text(line + "\n")
    with pytest.raises(NormswapError, match=needle):
        audio_mod.read_audio(str(spec), 16_000)


def _hostile_audio(tmp_path, case):
    """The ``--audio`` argument of one hostile input: the folder ``audio`` or a manifest in it."""
    folder = tmp_path / "audio"
    folder.mkdir()
    shutil.copy(BUNDLED_SPEECH / "sense-01.flac", tmp_path / "outside.flac")
    shutil.copy(BUNDLED_SPEECH / "sense-01.flac", folder / "inside.flac")
    manifest = folder / "m.jsonl"

    def lines(*entries):
        manifest.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
        return manifest

    def clip(samples, rate, text="hello there", subtype="PCM_16"):
        soundfile.write(folder / "a.wav", samples, rate, subtype=subtype)
        (folder / "a.txt").write_text(text)
        (folder / "inside.flac").unlink()
        return folder

    if case == "device":
        return Path("/dev/zero")
    if case == "fifo":
        os.mkfifo(tmp_path / "fifo.jsonl")
        return tmp_path / "fifo.jsonl"
    if case == "parent":
        return lines({"audio": "../outside.flac", "text": "hello"})
    if case == "absolute":
        return lines({"audio": str(tmp_path / "outside.flac"), "text": "hello"})
    if case == "link":
        (folder / "inside.flac").unlink()
        (folder / "a.flac").symlink_to(tmp_path / "outside.flac")
        (folder / "a.txt").write_text("hello")
        return folder
    if case == "long-transcript":
        return clip(np.zeros(1600, "int16"), 16_000, text="word " * 10_000)
    if case == "surrogate":
        return lines({"audio": "inside.flac", "text": "\ud800"})
    if case == "rate-1":
        return clip(np.zeros(2000, "int16"), 1)
    if case == "nan":
        samples = np.zeros(1600, "float32")
        samples[100] = np.nan
        return clip(samples, 16_000, subtype="FLOAT")
    if case == "corrupt-mp3":
        (folder / "a.mp3").write_bytes(np.random.default_rng(0).integers(0, 256, 20_000, dtype="uint8").tobytes())
        (folder / "a.txt").write_text("hello")
        (folder / "inside.flac").unlink()
        return folder
    assert case == "too-many"
    return lines(*[{"audio": "inside.flac", "text": "hello"}] * (audio_mod.MAX_UTTERANCES + 1))


@pytest.mark.parametrize("case, needle", [
    ("device", "neither a folder nor a regular file"),
    ("fifo", "neither a folder nor a regular file"),
    ("parent", "line 1: .* resolves to .*, outside the audio folder"),
    ("absolute", "line 1: .* resolves to .*, outside the audio folder"),
    ("link", "is a link to .*, outside the audio folder"),
    ("long-transcript", "longer than 20000 characters"),
    ("surrogate", "line 1 is not valid Unicode"),
    ("rate-1", "declares a sample rate of 1 Hz"),
    ("nan", "holds non-finite samples"),
    ("corrupt-mp3", "cannot read audio file .*a.mp3: not audio that libsndfile can decode"),
    ("too-many", "more than 4096 utterances"),
])
def test_hostile_audio_is_one_line(tmp_path, capfd, case, needle):
    spec = _hostile_audio(tmp_path, case)
    with pytest.raises(NormswapError, match=needle) as refused:
        audio_mod.read_audio(str(spec), 16_000)
    assert "\n" not in str(refused.value)
    assert capfd.readouterr().err == ""  # nothing from libsndfile's decoders on the C stream


def test_long_audio_is_decoded_only_as_far_as_it_is_read(tmp_path, monkeypatch):
    with soundfile.SoundFile(tmp_path / "a.flac", "w", 8000, 2, format="FLAC") as handle:
        for _ in range(10):  # ten minutes of stereo
            handle.write(np.zeros((8000 * 60, 2), "int16"))
    (tmp_path / "a.txt").write_text("hello there")
    read = []
    original = soundfile.SoundFile.read
    monkeypatch.setattr(soundfile.SoundFile, "read", lambda self, frames=-1, **kw: read.append(frames) or original(
        self, frames, **kw))
    [utterance] = audio_mod.read_audio(str(tmp_path), 16_000, max_seconds=2.0).utterances
    assert len(utterance.audio) == 32_000 and sum(read) <= 8000 * 2.1 and -1 not in read


def test_calibration_tokens_bound_what_is_decoded(models, tmp_path, monkeypatch):
    from normswap.evaluation import speech
    from normswap.runtime.reference import load_tokenizer

    src = models["whisper"][0]
    shutil.copy(BUNDLED_SPEECH / "sense-01.flac", tmp_path)
    (tmp_path / "m.jsonl").write_text("".join(
        json.dumps({"audio": "sense-01.flac", "text": "hello there"}) + "\n" for _ in range(600)))
    decoded = []
    original = audio_mod._decode
    monkeypatch.setattr(audio_mod, "_decode", lambda file, seconds: decoded.append(file) or original(file, seconds))
    config = json.loads((src / "config.json").read_text())
    data = speech.prepare(src, str(tmp_path / "m.jsonl"), load_tokenizer(src), config, max_tokens=2)
    assert len(decoded) == 1 and len(data.labels) == 1 and data.features.shape[0] == 1


def test_speech_inputs_the_feature_extractor_cannot_hold(models, tmp_path, monkeypatch):
    from normswap.evaluation import speech
    from normswap.runtime.reference import load_tokenizer

    src = models["whisper"][0]
    soundfile.write(tmp_path / "loud.wav", np.full(1600, 3e38, "float32"), 16_000, subtype="FLOAT")
    (tmp_path / "loud.txt").write_text("hello there")
    config = json.loads((src / "config.json").read_text())
    with pytest.raises(NormswapError, match="features of utterance 'loud' are not finite"):
        speech.prepare(src, str(tmp_path), load_tokenizer(src), config)
    monkeypatch.setattr(speech, "checkpoint_processor", lambda *args: object())
    with pytest.raises(NormswapError, match="builds a object; a Whisper model reads"):
        speech.feature_extractor(src)


def test_images_with_labels_and_errors(tmp_path):
    images = media.read_images(media.BUNDLED)
    assert images.labels == ["circle", "square", "triangle"] and len(images.images) == 6
    (tmp_path / "a.png").write_bytes(b"not a png")
    with pytest.raises(NormswapError, match="cannot read image file"):
        media.read_images(str(tmp_path))
    with pytest.raises(NormswapError, match="image path not found"):
        media.read_images(str(tmp_path / "nowhere"))
    (tmp_path / "a.png").unlink()
    with pytest.raises(NormswapError, match="no images"):
        media.read_images(str(tmp_path))


def test_wer_is_jiwer_after_normalisation():
    assert word_error_rate(["Hello, World!"], ["hello world"]) == 0.0
    assert word_error_rate(["a b c d"], ["a x c"]) == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------
# the commands


def _report(tmp_path):
    return json.loads((tmp_path / "report.json").read_text())


@pytest.mark.slow
def test_whisper_eval_side_by_side(models, two_utterances, tmp_path, capsys):
    src, out = models["whisper"]
    code = main(["eval", str(out), "--baseline", str(src), "--audio", str(two_utterances),
                              "--device", "cpu", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = _report(tmp_path)
    assert report["verdict"] == "pass" and report["modality"] == "audio"
    keys = {row["key"] for row in report["comparison"]["metrics"]}
    assert keys == {"speech/token_perplexity", "speech/wer"}
    [documents] = report["comparison"]["documents"]
    assert documents["n_docs"] == 2 and documents["max_abs_delta_ll"] < 1e-3
    assert report["agreement"][0]["key"] == "speech/identical_decodes" and report["agreement"][0]["value"] == 1.0
    assert "speech/identical_decodes" in printed and "## Samples" in printed


@pytest.mark.slow
def test_whisper_eval_catches_a_broken_conversion(models, two_utterances, tmp_path, capsys):
    """A naive swap (no centring) must fail the speech comparison."""
    src, _ = models["whisper"]
    naive = tmp_path / "naive"
    normswap.convert_checkpoint(src, naive, method="naive", allow_inexact=True, quiet=True)
    code = main(["eval", str(naive), "--baseline", str(src), "--audio", str(two_utterances),
                              "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 3, captured.out
    assert "FAIL" in captured.out


@pytest.mark.slow
def test_whisper_geometry_on_audio(models, two_utterances, tmp_path, capsys):
    src, out = models["whisper"]
    code = main(["geometry", str(src), "--compare", str(out), "--audio", str(two_utterances),
                              "--out", str(tmp_path / "g")])
    printed = capsys.readouterr().out
    assert code == 0
    assert "side encoder:" in printed and "side decoder:" in printed
    reports = json.loads((tmp_path / "g" / "report.json").read_text())
    original, converted = reports["original"], reports["converted"]
    stacks = {n["name"]: n["stack"] for n in original["norms"]}
    assert stacks["model.decoder.layers.0.encoder_attn_layer_norm"] == "decoder"
    assert {"encoder", "decoder"} <= set(original["overall"]["by_stack"])
    assert original["overall"]["by_stack"]["encoder"]["mean_share_avg"] > 0.1
    assert converted["overall"]["mean_at_noise"]


def _image_eval(models, family: str, tmp_path, capsys) -> tuple:
    """``eval`` of the converted image model against its original on the bundled images: the
    original's path, the report, and the report's agreement rows by key."""
    src, out = models[family]
    code = main(["eval", str(out), "--baseline", str(src), "--images", "bundled", "--device", "cpu",
                 "--out", str(tmp_path)])
    capsys.readouterr()
    assert code == 0
    report = _report(tmp_path)
    return src, report, {row["key"]: row["value"] for row in report["agreement"]}


def test_vit_eval_and_geometry(models, tmp_path, capsys):
    src, report, agreement = _image_eval(models, "vit", tmp_path, capsys)
    assert agreement["vit/top1_agreement"] == 1.0 and agreement["vit/max_abs_delta_logit"] < 1e-4
    assert "vit/accuracy" in report["models"]["original"]["metrics"]
    code = main(["geometry", str(src), "--images", str(BUNDLED_IMAGES)])
    assert code == 0 and "mean share" in capsys.readouterr().out


def test_clip_eval_and_geometry(models, tmp_path, capsys):
    src, report, agreement = _image_eval(models, "clip", tmp_path, capsys)
    assert agreement["clip/similarity_agreement"] == 1.0
    assert agreement["clip/min_cosine_image_embedding"] > 0.9999
    assert agreement["clip/min_cosine_text_embedding"] > 0.9999
    assert "clip/zero_shot_accuracy" in report["models"]["converted"]["metrics"]
    code = main(["geometry", str(src), "--images", "bundled"])
    printed = capsys.readouterr().out
    assert code == 0 and "side vision:" in printed and "side text:" in printed


def test_a_backbone_report_shows_what_was_measured_under_its_own_name(models, tmp_path, capsys):
    """DINOv2 has no classifier: the report says so, and shows the pooled and per-token agreement,
    over all images and per image, under dinov2/, with no empty score tables."""
    _, report, agreement = _image_eval(models, "dinov2", tmp_path, capsys)
    assert set(agreement) == {f"dinov2/{key}" for key in ("min_cosine_pooled_output", "max_abs_delta_pooled_output",
                                                          "min_cosine_token_hidden_state",
                                                          "max_abs_delta_token_hidden_state")}
    assert agreement["dinov2/min_cosine_token_hidden_state"] > 0.9999 and report["verdict"] == "pass"
    assert "no classification head" in report["unscored"]
    assert len(report["samples"]) == 6 and {"pooled cosine", "token max abs Δ"} <= set(report["samples"][0])
    markdown = (tmp_path / "report.md").read_text()
    assert "Nothing to score: dinov2 has no classification head" in markdown and "## Per image" in markdown
    assert "task/metric" not in markdown and "Per-document" not in markdown and "vit/" not in markdown


# ---------------------------------------------------------------------------------------------
# one line for every wrong input


@pytest.mark.parametrize("command", ["eval", "geometry"])
def test_media_errors_are_one_line(models, tmp_path, capsys, command):
    whisper, _ = models["whisper"]
    vit, _ = models["vit"]
    gpt2 = "normswap:austen-gpt2"
    no_transcript = tmp_path / "no-transcript"
    no_transcript.mkdir()
    shutil.copy(BUNDLED_SPEECH / "sense-01.flac", no_transcript)
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "x.wav").write_bytes(b"garbage")
    (unreadable / "x.txt").write_text("words")
    cases = [
        ([str(whisper), "--audio", str(tmp_path / "nowhere")], "audio path not found"),
        ([str(whisper), "--audio", str(no_transcript)], "transcript missing"),
        ([str(whisper), "--audio", str(unreadable)], "cannot read audio file"),
        ([str(whisper)], "reads audio, not text: pass --audio"),
        ([str(vit)], "reads images, not text: pass --images"),
        ([gpt2, "--audio", "bundled"], "--audio needs a model that reads audio"),
        ([gpt2, "--images", "bundled"], "--images needs a model that reads images"),
        ([str(vit), "--audio", "bundled"], "--audio needs a model that reads audio"),
        ([str(whisper), "--images", "bundled"], "--images needs a model that reads images"),
        ([str(vit), "--images", str(tmp_path / "nowhere")], "image path not found"),
        ([str(vit), "--audio", "bundled", "--images", "bundled"], "not both"),
    ]
    for args, needle in cases:
        code, err = run_cli(capsys, command, *args, *(["--device", "cpu"] if command == "eval" else []))
        assert_one_line_error(code, err, needle)
