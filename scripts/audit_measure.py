"""Measurements of one transformers model type on a tiny model, for the coverage audit.

``measure(model_type)`` builds the type's default config shrunk to a tiny size (widths 32, four
heads, two layers, a 64-token vocabulary; if the shrunk config does not build or run, the same
with the default depths), the class transformers' Auto mappings give it, in float64, and runs it
on generic inputs that fit its ``forward``: token ids, images (``pixel_values``), audio
(``input_values``, or ``input_features`` in either layout), both towers' inputs for a two-tower
model, ``decoder_input_ids`` for an encoder-decoder. Nothing here knows a family:

* a **centring norm** is a leaf module whose class name says "norm" and whose output does not
  change when its input moves by c·1 along the last dimension (LayerNorm does, RMSNorm does not);
* a **stack** is a ModuleList of modules of one class (one, for ALBERT's shared layer) that hold
  a centring norm and map a [batch, tokens, width] input to an output of that shape (the blocks);
* the **shift** of a stack is how far its first block's output moves, as a fraction of c, when
  the input the model gave that block moves by c·1: 1 for a pre-LN block (every norm removes the
  shift, the residual carries it through), 0 for a post-LN block (its last norm removes it).
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from importlib import util
from pathlib import Path

TINY = {"hidden_size": 32, "d_model": 32, "n_embd": 32, "n_embed": 32, "embed_dim": 32, "dim": 32,
        "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "num_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 64, "ffn_dim": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "n_inner": 64,
        "vocab_size": 64, "max_position_embeddings": 64, "n_positions": 64, "rotary_dim": 4,
        "image_size": 32, "patch_size": 8, "projection_dim": 16, "projection_size": 32}
DEPTHS = {"num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "encoder_layers": 2,
          "decoder_layers": 2}
SHIFT = 10.0


def shrunk(values: dict, sizes: dict) -> dict:
    """``values`` (a config's dict) with every integer key in ``sizes`` replaced, nested configs too."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out[key] = shrunk(value, sizes)
        elif key in sizes and isinstance(value, int) and not isinstance(value, bool):
            out[key] = sizes[key]
        elif key == "num_key_value_heads" and value is None:  # a class that reads None as "no grouping" badly
            out[key] = sizes["num_attention_heads"]
        elif isinstance(key, str) and key.endswith("token_id") and isinstance(value, int) and value >= sizes["vocab_size"]:
            out[key] = 1  # special tokens inside the tiny vocabulary
        else:
            out[key] = value
    return out


def tiny_configs(model_type: str) -> list:
    """The shrunk configs to try, smallest first (none when neither builds: a full-size default
    model could fill the memory)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    configs, failure = [], None
    for sizes in ({**TINY, **DEPTHS}, TINY):
        try:
            configs.append(type(default).from_dict(shrunk(default.to_dict(), sizes)))
        except Exception as error:  # a config class that checks its sizes against each other
            failure = error
    if not configs:
        raise failure
    return configs


def model_class(config):
    """The class transformers' Auto mappings build for ``config``: the base model, else a head."""
    import transformers

    for mapping in ("MODEL_MAPPING", "MODEL_FOR_CAUSAL_LM_MAPPING", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
                    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING", "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING",
                    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING"):
        try:
            return getattr(transformers, mapping)[type(config)]
        except (KeyError, AttributeError):
            continue
    # a sub-model's config (a tower of a two-tower model): the model class declaring it
    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    classes = [value for name, value in vars(module).items() if isinstance(value, type)
               and getattr(value, "config_class", None) is type(config) and name.endswith("Model")]
    if classes:
        return min(classes, key=lambda cls: len(cls.__name__))
    raise LookupError("no model class in transformers' Auto mappings or its modeling module")


def candidate_inputs(model, config) -> list[dict]:
    """Inputs to try, in order: every kind ``forward`` takes at once, then its main input alone."""
    import torch

    generator = torch.Generator().manual_seed(0)
    accepted = inspect.signature(model.forward).parameters
    text = getattr(config, "text_config", None) or config
    vocab = int(getattr(text, "vocab_size", 64) or 64)
    ids = torch.randint(2, max(3, min(vocab, 60)), (1, 8), generator=generator)
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", 32)
    size = int(size if isinstance(size, int) else size[0])
    channels = int(getattr(vision, "num_channels", 3) or 3)
    audio = getattr(config, "audio_config", None) or config
    mels = int(getattr(audio, "num_mel_bins", 0) or getattr(audio, "feature_size", 0) or 80)
    frames = 2 * int(getattr(audio, "max_source_positions", 0) or 32)
    kinds = {"input_ids": ids,
             "pixel_values": torch.randn(1, channels, size, size, generator=generator, dtype=torch.float64),
             "input_values": torch.randn(1, 4000, generator=generator, dtype=torch.float64),
             "input_features": torch.randn(1, mels, frames, generator=generator, dtype=torch.float64)}
    together = {key: value for key, value in kinds.items() if key in accepted}
    if "input_features" in together and "input_values" in together:
        del together["input_values"]
    main = getattr(model, "main_input_name", "input_ids")
    candidates = [together, {main: kinds[main]} if main in kinds else {}]
    if "input_values" in accepted and mels:  # a spectrogram [batch, frames, mel bins]
        frames_in = int(getattr(audio, "max_length", 0) or 64)
        candidates.append({"input_values": torch.randn(1, frames_in, mels, generator=generator, dtype=torch.float64)})
    if "input_features" in accepted:  # (batch, frames, features): the other layout speech models use
        width = mels * int(getattr(audio, "input_channels", 1) or 1)
        candidates.append({"input_features": torch.randn(1, 64, width, generator=generator, dtype=torch.float64)})
    extra = {}
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in accepted:
        extra["decoder_input_ids"] = ids
    if "use_cache" in accepted:
        extra["use_cache"] = False
    unique, seen = [], set()
    for candidate in candidates:
        signature = tuple(sorted((key, tuple(value.shape)) for key, value in candidate.items()))
        if candidate and signature not in seen:
            seen.add(signature)
            unique.append({**candidate, **extra})
    return unique


def cast(inputs: dict, dtype) -> dict:
    """Floating tensors of ``inputs`` in ``dtype``."""
    return {key: value.to(dtype) if getattr(value, "is_floating_point", lambda: False)() else value
            for key, value in inputs.items()}


def norm_width(module) -> int | None:
    """The width a norm normalises over (its last axis)."""
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and shape:
        return int(shape[-1])
    if isinstance(shape, int):
        return shape
    for name in ("weight", "bias"):
        tensor = getattr(module, name, None)
        if tensor is not None and getattr(tensor, "ndim", 0) >= 1:
            return int(tensor.shape[-1])
    return None


def centres(module) -> bool:
    """Whether ``module`` is a norm whose output ignores a shift of its input by c·1."""
    import torch

    if next(module.children(), None) is not None or "norm" not in type(module).__name__.lower():
        return False
    width = norm_width(module)
    if width is None or width < 2:
        return False
    x = torch.randn(2, 3, width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            moved, still = module(x + SHIFT), module(x)
    except Exception:  # a norm over another axis (GroupNorm over channels, BatchNorm)
        return False
    if not isinstance(moved, torch.Tensor) or moved.shape != still.shape:
        return False
    return bool((moved - still).abs().max() < 1e-6 * max(1.0, float(still.abs().max())))


def stacks(model) -> list[tuple[str, object]]:
    """(name, first block) of every ModuleList of same-class blocks that hold a centring norm."""
    from torch import nn

    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1 \
                and any(centres(m) for m in module[0].modules()):
            found.append((name, module[0]))
    return found


def block_shifts(model, blocks: list[tuple[str, object]], inputs: dict) -> tuple[dict[str, float], set[str]]:
    """The shift of each stack whose first block took a [batch, tokens, width] tensor and kept its
    shape, and the names of the stacks the inputs reached."""
    import torch

    calls, handles = {}, []
    for name, block in blocks:
        def keep(module, args, kwargs, name=name):
            calls.setdefault(name, (args, kwargs))
        handles.append(block.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    shifts = {}
    for name, block in blocks:
        if name in calls:
            shift = _shift(block, *calls[name])
            if shift is not None:
                shifts[name] = shift
    return shifts, set(calls)


def tower_shifts(model, config, blocks: list[tuple[str, object]], dtype) -> dict[str, float]:
    """Shifts of stacks the whole model's inputs did not reach (a vision-language model's image
    tower, for token ids alone), each run through the nearest enclosing module that takes inputs."""

    shifts = {}
    for name, block in blocks:
        parts = name.split(".")
        for end in range(len(parts) - 1, 0, -1):
            tower = model.get_submodule(".".join(parts[:end]))
            if not set(inspect.signature(tower.forward).parameters) & {"pixel_values", "input_values",
                                                                        "input_features", "input_ids"}:
                continue
            for inputs in candidate_inputs(tower, getattr(tower, "config", None) or config):
                try:
                    found, _ = block_shifts(tower, [(".".join(parts[end:]), block)], cast(inputs, dtype))
                except Exception:  # not this tower's inputs
                    continue
                if found:
                    shifts[name] = next(iter(found.values()))
                break
            if name in shifts:
                break
    return shifts


def _shift(block, args: tuple, kwargs: dict) -> float | None:
    import torch

    key = None if args else "hidden_states"
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3 or not hidden.is_floating_point():
        return None
    # a block handed a cache would append to it on every run
    kwargs = {k: (None if "past_key_value" in k else False if k == "use_cache" else v) for k, v in kwargs.items()}

    def run(delta: float):
        moved = hidden + delta
        out = block(moved, *args[1:], **kwargs) if key is None else block(**{**kwargs, key: moved})
        return out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)

    with torch.no_grad():
        base = run(0.0)
        if not isinstance(base, torch.Tensor) or base.shape != hidden.shape:
            return None
        return round(float((run(SHIFT) - base).mean()) / SHIFT, 3) + 0.0  # no -0.0


def source_has_layer_norm(model_type: str) -> bool:
    """Whether the type's modeling source names a LayerNorm (read as text, nothing imported)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    spec = util.find_spec("transformers.models")
    folder = Path(spec.submodule_search_locations[0]) / model_type_to_module_name(model_type)
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in folder.glob("modeling_*.py")]
    return any(re.search(r"nn\.LayerNorm\b|class \w*LayerNorm\w*\(|\bF\.layer_norm\(|functional\.layer_norm\(", text)
               for text in texts)


def measure_config(config) -> dict:
    """Centring norms and stack shifts of the model ``config`` builds; ``error`` if it cannot run
    (the error of the first inputs tried, which hold every kind ``forward`` takes)."""
    import torch

    try:
        cls = model_class(config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cls(config).double().eval()
    except Exception as error:  # the registry holds classes a tiny default config cannot build
        return {"error": f"{type(error).__name__}: {error}"}
    row = {"model_class": cls.__name__, "centring_norms": sum(centres(module) for module in model.modules())}
    if not row["centring_norms"]:
        return row
    blocks, failures = stacks(model), []
    # float32 where an op has no float64 kernel; the shift is read to 0.05, far above its rounding
    for dtype in (torch.float64, torch.float32):
        model.to(dtype)
        for inputs in candidate_inputs(model, config):
            try:
                shifts, reached = block_shifts(model, blocks, cast(inputs, dtype))
            except Exception as error:
                failures.append(f"{type(error).__name__}: {error}")
                continue
            towers = tower_shifts(model, config, [(n, b) for n, b in blocks if n not in reached], dtype)
            return {**row, "shifts": {**shifts, **towers}, "dtype": str(dtype).split(".")[-1],
                    "inputs": sorted(key for key in inputs if key != "use_cache"),
                    **({"towers": sorted(towers)} if towers else {})}
    return {**row, "error": failures[0] if failures else "no inputs"}


def norm_switches(config) -> list[str]:
    """The config's boolean settings whose names say "norm" (``do_stable_layer_norm``, ...)."""
    return sorted(key for key, value in config.to_dict().items() if isinstance(value, bool) and "norm" in key.lower())


def measure(model_type: str) -> dict:
    """One row of measurements, with the default config's norm switches flipped as variants."""
    import torch

    torch.manual_seed(0)
    row: dict = {"model_type": model_type}
    try:
        configs = tiny_configs(model_type)
    except Exception as error:
        configs, row["error"] = [], f"{type(error).__name__}: {error}"
    for config in configs:
        found = measure_config(config)
        row.update(found)
        if "error" not in found:
            row.pop("error", None)
            variants = {}
            for key in norm_switches(config) if found.get("centring_norms") else []:
                flipped = type(config).from_dict({**config.to_dict(), key: not getattr(config, key)})
                variants[f"{key}={not getattr(config, key)}"] = measure_config(flipped).get("shifts")
            if variants:
                row["variants"] = variants
            break
    if "error" in row:
        row["error"] = " ".join(str(row["error"]).split())[:200]
        if "centring_norms" not in row:
            row["layer_norm_in_source"] = source_has_layer_norm(model_type)
    return row

