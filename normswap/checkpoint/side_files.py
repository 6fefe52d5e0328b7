"""A checkpoint's side files, read within bounds and checked against its config.json before any
library reads them.

transformers builds a feature extractor, an image processor or a generation config from whatever
these files say: a ``sampling_rate`` of 0 fails deep in scipy, a ViT processor asking for
100000x100000 images allocates until the kernel kills the process, and a generation config that
selects a decoding strategy transformers moved to the hub (contrastive search, DoLa, group or
constrained beam search) asks to fetch and run code from there. Every JSON side file is read
through ``bounded.read_json`` first; the processor and generation configs are then held to what
the model's own config allows and to what normswap uses (greedy decoding, one beam), the
tokenizer's ids to the model's vocabulary, and config.json to the keys that steer transformers
(``check_steering_keys``: attention kernels, quantisation, output shape).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from normswap.checkpoint.bounded import read_json, read_json_once
from normswap.errors import NormswapError

# the JSON files of a checkpoint folder that normswap or the libraries it calls read
JSON_FILES = (
    "config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
    "preprocessor_config.json", "processor_config.json", "feature_extractor_config.json",
    "image_processor_config.json", "added_tokens.json", "model.safetensors.index.json",
    "pytorch_model.bin.index.json", "chat_template.json", "tokenizer.json", "vocab.json",
)
# read by the tokenizers library, whose parser bounds its own depth; normswap reads their vocabulary
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
SAMPLING_RATES = (1000, 768000)  # Hz: telephone speech up to the highest studio rates
# a feature extractor's sizes: windows up to 4096 samples, clips up to 60 s and 2**22 samples
# (Whisper: 400, 160, 30 s, 480000, 80 or 128 mel bins)
AUDIO_SIZES = {"n_fft": 4096, "hop_length": 4096, "chunk_length": 60, "feature_size": 512}
MAX_CHUNK_SAMPLES = 1 << 22
# waveform values in [-1, 1]: the noise added to each sample and the value of padding
AUDIO_LEVELS = {"dither": (0.0, 1.0), "padding_value": (-1.0, 1.0)}
# model type -> the feature extractor and processor classes its preprocessor_config.json may name
FEATURE_EXTRACTORS = {"whisper": ("WhisperFeatureExtractor", "WhisperProcessor")}
MAX_IMAGE_SCALE = 8  # a processor may resize to at most this multiple of the model's image size
# families whose models resample their position table to each input's size (bicubic, in float32)
# on every call: on transformers 5.24 DINOv2 and BEiT read any image of at least one patch, while
# ViT, DeiT and CLIP refuse a size other than image_size unless called with
# interpolate_pos_encoding=True, which neither transformers' pipelines nor normswap pass
ANY_IMAGE_SIZE_FAMILIES = frozenset({"dinov2", "beit"})
MAX_IMAGE_SIDE = 4096  # ... or, for a model whose config names no image size, to this many pixels
# |image_mean| and image_std bounds: pixels are normalised from [0, 1] or [0, 255] (a mean of 0 is allowed)
NORMALISATION = {"image_mean": (1e-6, 1e3), "image_std": (1e-6, 1e3)}
# generation settings that select a decoding strategy transformers fetches from the hub, or one
# normswap does not run (it decodes greedily with one beam), and the value that leaves it off
OFF_HUB_STRATEGIES = {
    "penalty_alpha": None, "dola_layers": None, "num_beam_groups": 1, "constraints": None,
    "force_words_ids": None, "custom_generate": None, "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None, "use_mtp": False, "watermarking_config": None,
}
GENERATION_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                        "forced_bos_token_id", "forced_eos_token_id", "no_timestamps_token_id")
GENERATION_TOKEN_LISTS = ("suppress_tokens", "begin_suppress_tokens")
GENERATION_COUNTS = ("max_length", "max_new_tokens", "num_beams")


def check_side_files(folder: Path) -> None:
    """Read every JSON side file of the checkpoint ``folder`` within bounds, and check its
    processor and generation configs against its config.json (one line for the first problem)."""
    found = {name: read_json_once(folder / name) if name == "config.json"
             else read_json(folder / name, walk=name not in TOKENIZER_FILES)
             for name in JSON_FILES if (folder / name).is_file()}
    config = found.get("config.json")
    if config is None:
        return
    check_steering_keys(config, f"{folder / 'config.json'}")
    if "preprocessor_config.json" in found:
        check_processor(found["preprocessor_config.json"], config, f"{folder / 'preprocessor_config.json'}")
    if "generation_config.json" in found:
        check_generation(found["generation_config.json"], config, f"{folder / 'generation_config.json'}")
    ids = tokenizer_ids(found)
    if ids is not None:
        check_token_ids(ids, vocab_size(config), f"{folder}")


def tokenizer_ids(found: dict[str, dict]) -> int | None:
    """One past the largest token id the tokenizer files in ``found`` (name -> parsed JSON) name:
    the vocabulary of tokenizer.json or vocab.json and every added token; None without them."""
    ids: list[int] = []
    model = found.get("tokenizer.json", {}).get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else found.get("vocab.json")
    if isinstance(vocab, dict):
        ids += [value for value in vocab.values() if _natural(value)]
    elif isinstance(vocab, list):  # a unigram model lists its pieces in id order
        ids.append(len(vocab) - 1)
    for token in found.get("tokenizer.json", {}).get("added_tokens") or []:
        if isinstance(token, dict) and _natural(token.get("id")):
            ids.append(token["id"])
    ids += [value for value in found.get("added_tokens.json", {}).values() if _natural(value)]
    decoder = found.get("tokenizer_config.json", {}).get("added_tokens_decoder")
    if isinstance(decoder, dict):
        ids += [int(key) for key in decoder if isinstance(key, str) and key.isdigit() and len(key) < 12]
    return max(ids) + 1 if ids else None


# config keys that make transformers choose code to run: the attention and expert kernels (a
# value may name a hub repository of kernels, which transformers would fetch and run), and the
# weights' dtype; the values normswap lets through (None: the key is absent or null)
ATTENTION_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")
EXPERTS_KEYS = ("experts_implementation", "_experts_implementation", "_experts_implementation_internal")
ATTENTION_CHOICES = (None, "eager", "sdpa")
DTYPE_KEYS = ("dtype", "torch_dtype")
# keys that change what a model's forward returns, and the values that leave it as normswap reads it
OUTPUT_KEYS = {"return_dict": (None, True), "torchscript": (None, False)}
DTYPE_CHOICES = (None, "auto", "float16", "bfloat16", "float32", "float64")


def check_steering_keys(config: dict, where: str) -> None:
    """Refuse the config keys that would make transformers fetch or run code the user never named
    (a hub kernel as attention), or load weights normswap does not convert (``quantization_config``).

    ``auto_map`` (the checkpoint's own classes) runs only with ``--trust-remote-code``, elsewhere.
    """
    subs = [(f"{key}.", config[key]) for key in ("text_config", "vision_config") if isinstance(config.get(key), dict)]
    for prefix, sub in [("", config), *subs]:
        quantised = sub.get("quantization_config")
        if quantised is not None:
            method = quantised.get("quant_method") if isinstance(quantised, dict) else None
            named = f" ({method!r:.30})" if isinstance(method, str) else ""
            raise NormswapError(f"{where}: '{prefix}quantization_config' says the checkpoint is quantised{named}; "
                                "normswap converts floating-point weights only (dequantise it first)")
        for key in ATTENTION_KEYS + EXPERTS_KEYS:
            value = sub.get(key)
            values = list(value.values()) if isinstance(value, dict) else [value]
            if any(item not in ATTENTION_CHOICES for item in values):
                raise NormswapError(f"{where}: '{prefix}{key}' = {_show(value)}; normswap runs only transformers' "
                                    "own eager or sdpa attention and loads no kernel a config names")
        for key, allowed in OUTPUT_KEYS.items():
            if sub.get(key) not in allowed:
                raise NormswapError(f"{where}: '{prefix}{key}' = {_show(sub.get(key))} makes the model return plain "
                                    "tuples; normswap reads its named outputs (remove the key)")
        for key in DTYPE_KEYS:
            if sub.get(key) not in DTYPE_CHOICES:
                raise NormswapError(f"{where}: '{prefix}{key}' = {_show(sub.get(key))} is not a floating dtype "
                                    f"({', '.join(str(choice) for choice in DTYPE_CHOICES[1:])})")


def vocab_size(config: dict) -> int | None:
    """The model's vocabulary size (a text sub-config's for CLIP), or None when it declares none."""
    for sub in (config, config.get("text_config")):
        value = sub.get("vocab_size") if isinstance(sub, dict) else None
        if _positive_int(value):
            return value
    return None


def check_token_ids(tokenizer_ids: int, vocab: int | None, where: str) -> None:
    """Refuse a tokenizer whose largest id (``tokenizer_ids`` ids in all) lies past the model's
    embedding table: every such token would index past its end."""
    if vocab is not None and tokenizer_ids > vocab:
        raise NormswapError(f"{where}: the tokenizer has token ids up to {tokenizer_ids - 1}, but the model's "
                            f"vocabulary holds {vocab} (vocab_size); the tokenizer does not belong to this model")


def check_processor(data: dict, config: dict, where: str) -> None:
    """A feature extractor's audio settings and an image processor's sizes, against the model."""
    # a converted checkpoint's own type is its family's, or normswap_<family> for the free form
    extractors = FEATURE_EXTRACTORS.get(str(config.get("model_type")).removeprefix("normswap_"))
    if extractors is not None:
        _check_extractor_class(data, extractors, where)
    if extractors is not None or "sampling_rate" in data or "feature_size" in data:
        _check_audio(data, config, where)
    if any(key in data for key in ("size", "crop_size", "image_mean", "image_std", "image_processor_type", "do_resize")):
        _check_images(data, config, where)


def _check_extractor_class(data: dict, allowed: tuple[str, str], where: str) -> None:
    """The classes transformers would build from the file (``feature_extractor_type``, or one
    derived from ``processor_class``) must be the model family's own."""
    for key, name in zip(("feature_extractor_type", "processor_class"), allowed, strict=True):
        if key in data and data[key] != name:
            raise NormswapError(f"{where}: '{key}' = {_show(data[key])}; this model reads the features of its own "
                                f"{name}")


def _check_audio(data: dict, config: dict, where: str) -> None:
    low, high = SAMPLING_RATES
    rate = data.get("sampling_rate", 16000)
    if not (_positive_int(rate) and low <= rate <= high):
        raise NormswapError(f"{where}: 'sampling_rate' must be a whole number of Hz from {low} to {high} "
                            f"(got {_show(rate)})")
    for key, most in AUDIO_SIZES.items():
        if key in data and not (_positive_int(data[key]) and data[key] <= most):
            raise NormswapError(f"{where}: '{key}' must be a positive integer of at most {most} (got {_show(data[key])})")
    for key, (least, most) in AUDIO_LEVELS.items():
        if key in data and not (_finite(data[key]) and least <= data[key] <= most):
            raise NormswapError(f"{where}: '{key}' must be a number from {least:g} to {most:g} (got {_show(data[key])})")
    bins = config.get("num_mel_bins")
    if "feature_size" in data and _positive_int(bins) and data["feature_size"] != bins:
        raise NormswapError(f"{where}: 'feature_size' is {data['feature_size']}, but the model reads {bins} mel bins "
                            "(num_mel_bins)")
    if all(key in data for key in ("n_fft", "hop_length")) and data["hop_length"] > data["n_fft"]:
        raise NormswapError(f"{where}: 'hop_length' {data['hop_length']} is longer than 'n_fft' {data['n_fft']}")
    _check_chunk(data, config, rate, where)


def _check_chunk(data: dict, config: dict, rate: int, where: str) -> None:
    """One clip's samples (``chunk_length`` s at ``rate`` Hz, as ``n_samples`` and ``nb_max_frames``
    state them) within bounds and the frames the encoder reads."""
    chunk, hop = data.get("chunk_length", 30), data.get("hop_length", 160)
    samples = chunk * rate
    if samples > MAX_CHUNK_SAMPLES or data.get("n_fft", 400) > samples:
        raise NormswapError(f"{where}: {chunk} s at {rate} Hz makes {samples} samples per clip; normswap reads at most "
                            f"{MAX_CHUNK_SAMPLES}, and at least one window of 'n_fft'")
    positions = config.get("max_source_positions")
    if all(key in data for key in ("chunk_length", "hop_length")) and _positive_int(positions):
        frames = samples // hop
        if frames != 2 * positions:  # the encoder's two convolutions halve the frames once
            raise NormswapError(f"{where}: {chunk} s at {rate} Hz with hop {hop} makes {frames} frames, but the model "
                                f"reads {2 * positions} (twice max_source_positions)")
    for key, value in (("n_samples", samples), ("nb_max_frames", samples // hop)):
        if key in data and data[key] != value:
            raise NormswapError(f"{where}: '{key}' is {_show(data[key])}, but {chunk} s at {rate} Hz with hop {hop} "
                                f"makes {value}")


def _check_images(data: dict, config: dict, where: str) -> None:
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else config
    model_size = vision.get("image_size")
    model_pair = (model_size, model_size) if _positive_int(model_size) else (
        tuple(model_size) if isinstance(model_size, list) and len(model_size) == 2 else None)
    limit = MAX_IMAGE_SCALE * max(model_pair) if model_pair else MAX_IMAGE_SIDE
    sizes = {key: _image_size(data[key], key, limit, where) for key in ("size", "crop_size") if data.get(key) is not None}
    final = sizes.get("crop_size") if data.get("do_center_crop") and "crop_size" in sizes else sizes.get("size")
    final_pair = (final["height"], final["width"]) if final and "height" in final and "width" in final else None
    any_size = reads_any_image_size(config.get("model_type"))
    if any_size:
        _check_patches(final_pair or (final or {}).get("shortest_edge"), vision.get("patch_size"), where)
    elif model_pair and final_pair and final_pair != model_pair:
        raise NormswapError(f"{where}: the processor makes {final_pair[0]}x{final_pair[1]} images, but the model "
                            f"reads {model_pair[0]}x{model_pair[1]} (image_size)")
    if data.get("do_resize") is False and not (data.get("do_center_crop") and "crop_size" in sizes):
        reads = "batches of one size" if any_size else f"{'x'.join(map(str, model_pair or ('its',)))} images (image_size)"
        raise NormswapError(f"{where}: 'do_resize' false keeps each image's own size, but the model reads {reads}")
    _check_processor_type(data.get("image_processor_type"), config, where)
    if data.get("resample") is not None and data["resample"] not in range(6):
        raise NormswapError(f"{where}: 'resample' must be one of Pillow's filters 0 to 5 (got {_show(data['resample'])})")
    factor = data.get("rescale_factor")
    if factor is not None and not (_finite(factor) and factor > 0):
        raise NormswapError(f"{where}: 'rescale_factor' must be a positive number (got {_show(factor)})")
    channels = vision.get("num_channels", 3)
    for key in ("image_mean", "image_std"):
        value = data.get(key)
        values = value if isinstance(value, list) else [value]
        if value is None:
            continue
        if not all(_finite(item) for item in values) or (isinstance(value, list) and len(value) != channels):
            raise NormswapError(f"{where}: '{key}' must be a finite number or {channels} of them (got {_show(value)})")
        if key == "image_std" and any(item == 0 for item in values):
            raise NormswapError(f"{where}: 'image_std' holds 0, which divides every pixel by zero")
        low, high = NORMALISATION[key]
        if not all(low <= abs(item) <= high for item in values if not (key == "image_mean" and item == 0)):
            raise NormswapError(f"{where}: '{key}' must be of magnitude {low:g} to {high:g}, as pixel normalisation "
                                f"is (got {_show(value)})")


def reads_any_image_size(model_type: object) -> bool:
    """Whether a model of ``model_type`` (a config's, ``normswap_<family>`` for the free form)
    reads images of any size, resampling its position table to each (``ANY_IMAGE_SIZE_FAMILIES``)."""
    return str(model_type).removeprefix("normswap_") in ANY_IMAGE_SIZE_FAMILIES


def _check_patches(final: tuple[int, int] | int | None, patch_size: object, where: str) -> None:
    """A model that reads any image size still reads whole patches: the processor's images (or
    their shorter side, ``final`` as an int, when the resize keeps each image's aspect) must hold one."""
    patch = (patch_size, patch_size) if _positive_int(patch_size) else (
        tuple(patch_size) if isinstance(patch_size, list) and len(patch_size) == 2 else None)
    sides = (final, final) if isinstance(final, int) else final
    if patch and sides and (sides[0] < patch[0] or sides[1] < patch[1]):
        made = (f"resizes each image's shorter side to {final} pixels" if isinstance(final, int)
                else f"makes {sides[0]}x{sides[1]} images")
        raise NormswapError(f"{where}: the processor {made}, smaller than one {patch[0]}x{patch[1]} patch "
                            "(patch_size)")


def _check_processor_type(name: object, config: dict, where: str) -> None:
    """An image processor of the model's own family, or ViT's (which many vision checkpoints ship);
    another family's brings its own sizes and steps."""
    if name is None:
        return
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    family = str(config.get("model_type", "")).removeprefix("normswap_")
    allowed = set()
    for key in {family, "vit"} if family != "clip" else {family}:
        names = IMAGE_PROCESSOR_MAPPING_NAMES.get(key) or ()
        allowed |= {n.removesuffix("Pil").removesuffix("Fast") for n in (names.values() if isinstance(names, dict)
                                                                          else names) if isinstance(n, str)}
    if not isinstance(name, str) or name.removesuffix("Pil").removesuffix("Fast") not in allowed:
        raise NormswapError(f"{where}: 'image_processor_type' {_show(name)} is not an image processor of a "
                            f"{family} model ({', '.join(sorted(allowed))})")


def _image_size(value: Any, key: str, limit: int, where: str) -> dict[str, int]:
    """``size`` or ``crop_size`` as a mapping (an int means a square), each side from 1 to ``limit``."""
    sides = {"height": value, "width": value} if not isinstance(value, dict) else value
    allowed = {"height", "width", "shortest_edge", "longest_edge", "max_height", "max_width"}
    if not sides or set(sides) - allowed or not all(_positive_int(side) for side in sides.values()):
        raise NormswapError(f"{where}: '{key}' must be a positive integer or a mapping of "
                            f"{', '.join(sorted(allowed))} to positive integers (got {_show(value)})")
    widest = max(sides.values())
    if widest > limit:
        raise NormswapError(f"{where}: '{key}' asks for {widest}-pixel images; the model allows at most {limit} "
                            f"({MAX_IMAGE_SCALE} times its image_size)")
    return sides


def check_generation(data: dict, config: dict, where: str) -> None:
    """The settings of generation_config.json that normswap's greedy decoding uses, and no
    decoding strategy that would fetch code from the hub."""
    for key, off in OFF_HUB_STRATEGIES.items():
        value = data.get(key, off)
        if value not in (off, None) and not (key == "penalty_alpha" and value == 0):
            raise NormswapError(f"{where}: '{key}' = {_show(value)} selects a decoding strategy that transformers "
                                "loads from the hub or normswap does not run; normswap decodes greedily with one "
                                "beam and fetches no decoding code (remove the key)")
    vocab = vocab_size(config)
    for key in GENERATION_TOKEN_IDS:  # the decoder's first input must lie in its embedding table
        value = data.get(key)
        below = vocab if key == "decoder_start_token_id" else None
        for token in value if isinstance(value, list) else [value]:
            if token is not None and not _token(token, below):
                raise NormswapError(f"{where}: '{key}' must be a token id{f' below vocab_size {below}' if below else ''} "
                                    f"(got {_show(value)})")
    for key in GENERATION_TOKEN_LISTS:  # matched against the vocabulary, so ids past it do no harm
        value = data.get(key)
        if value is not None and not (isinstance(value, list) and all(_natural(token) for token in value)):
            raise NormswapError(f"{where}: '{key}' must be a list of token ids (got {_show(value)})")
    forced = data.get("forced_decoder_ids")
    if forced is not None and not (isinstance(forced, list) and all(
            isinstance(pair, list) and len(pair) == 2 and _natural(pair[0]) and _token(pair[1], vocab) for pair in forced)):
        raise NormswapError(f"{where}: 'forced_decoder_ids' must be a list of [position, token id] pairs")
    for key in GENERATION_COUNTS:
        if data.get(key) is not None and not _positive_int(data[key]):
            raise NormswapError(f"{where}: '{key}' must be a positive integer (got {_show(data[key])})")


def _token(value: object, vocab: int | None) -> bool:
    return _natural(value) and (vocab is None or value < vocab)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive_int(value: object) -> bool:
    return _natural(value) and value > 0


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
