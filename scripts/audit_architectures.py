"""Coverage audit: every transformers model type with a LayerNorm, classified by measurement.

For each model type in transformers' registry (CONFIG_MAPPING) the audit builds the default
config shrunk to a tiny size, the base model class (MODEL_MAPPING) in float64, and looks for
LayerNorm-like modules (``normswap.modeling.remote.layer_norm_like``). A type with none is not
listed. The others are classified with the **1** direction, on the first residual block: a
pre-LN block satisfies out(x + c·1) = out(x) + c·1 (every norm removes the shift, the residual
carries it), a post-LN block's output does not move. The shift is measured, not recalled:

* ``exact``: normswap has an adapter (each is tested for exactness against float64);
* ``refused``: normswap refuses it, with its reason; or the block is measured post-LN;
* ``not yet``: pre-LN by measurement (or not measurable on a tiny model, with the reason) and
  no adapter yet.

    python3 scripts/audit_architectures.py [--types gpt2 bert ...] [--json out/audit.json]

writes the table into docs/architectures.md between the audit markers (``--no-docs`` leaves it).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"
BEGIN, END = "<!-- audit:begin -->", "<!-- audit:end -->"
# config keys shrunk to a tiny model: widths to 32 (heads 4), depths to 2, tables to 64
TINY = {"hidden_size": 32, "d_model": 32, "n_embd": 32, "n_embed": 32, "embed_dim": 32, "dim": 32,
        "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "num_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 64, "ffn_dim": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "n_inner": 64,
        "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "encoder_layers": 2,
        "decoder_layers": 2, "vocab_size": 64, "max_position_embeddings": 64, "n_positions": 64,
        "image_size": 32, "patch_size": 8, "projection_dim": 16}


def tiny_config(model_type: str):
    """The default config of ``model_type`` with every size key in TINY (and nested configs) shrunk."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)

    def shrink(cfg, depth=0):
        for key, value in TINY.items():
            if isinstance(getattr(cfg, key, None), int) and not isinstance(getattr(cfg, key), bool):
                setattr(cfg, key, value)
        for key in ("text_config", "vision_config", "audio_config", "encoder", "decoder"):
            sub = getattr(cfg, key, None)
            if depth < 2 and hasattr(sub, "to_dict"):
                shrink(sub, depth + 1)
    shrink(config)
    return config


def _inputs(model, config) -> dict:
    import torch

    generator = torch.Generator().manual_seed(0)
    name = getattr(model, "main_input_name", "input_ids")
    text = getattr(config, "text_config", None) or config
    ids = torch.randint(2, min(int(getattr(text, "vocab_size", 64) or 64), 60), (1, 8), generator=generator)
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", 32)
    size = size if isinstance(size, int) else size[0]
    pixels = torch.randn(1, int(getattr(vision, "num_channels", 3)), size, size, generator=generator)
    inputs = {"input_ids": ids, "pixel_values": pixels}
    if name == "input_values":
        inputs = {"input_values": torch.randn(1, 4000, generator=generator)}
    elif name == "input_features":
        inputs = {"input_features": torch.randn(1, int(getattr(config, "num_mel_bins", 80)),
                                                2 * int(getattr(config, "max_source_positions", 32)), generator=generator)}
    elif name == "input_ids" or "pixel_values" not in inputs:
        inputs = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    return inputs


def first_block(model):
    """The first module of the longest ModuleList of same-class modules (the residual blocks)."""
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and
             len({type(x) for x in m}) == 1]
    return max(lists, key=len)[0] if lists else None


def measure_shift(model, config, shift: float = 10.0) -> float:
    """How far the first block's output moves, as a fraction of c, when its input moves by c·1:
    1 for a pre-LN block, 0 for a post-LN one."""
    import torch

    block, captured = first_block(model), {}
    if block is None:
        raise RuntimeError("no stack of residual blocks")

    def keep(module, args, kwargs):
        captured.setdefault("call", (args, kwargs))
    handle = block.register_forward_pre_hook(keep, with_kwargs=True)
    with torch.no_grad():
        try:
            model(**_inputs(model, config))
        finally:
            handle.remove()
        args, kwargs = captured["call"]

        def run(delta):
            if args:
                out = block(args[0] + delta, *args[1:], **kwargs)
            else:
                out = block(**{**kwargs, "hidden_states": kwargs["hidden_states"] + delta})
            return out[0] if isinstance(out, tuple) else out
        moved = run(shift) - run(0.0)
    return float(moved.mean()) / shift


def classify(model_type: str) -> dict:
    """One row of the audit: {"model_type", "status", "reason"}; None status: no LayerNorm."""
    import torch
    from transformers import MODEL_MAPPING

    from normswap.architectures import ARCHITECTURES, POST_LN
    from normswap.modeling.remote import layer_norm_like

    row = {"model_type": model_type}
    try:
        config = tiny_config(model_type)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = MODEL_MAPPING[type(config)](config).double().eval()
    except Exception as error:  # the registry holds classes a tiny default config cannot build
        if model_type in ARCHITECTURES:
            return {**row, "status": "exact", "reason": "adapter; exact against float64 in the tests (no tiny "
                    "model from the default config here)"}
        return {**row, "status": "not yet", "reason": f"no tiny model from the default config ({type(error).__name__})"}
    norms = [name for name, module in model.named_modules() if layer_norm_like(module)]
    if not norms:
        return {**row, "status": None, "reason": "no LayerNorm"}
    try:
        row["shift"] = round(measure_shift(model, config), 3)
    except Exception as error:
        row["shift"] = None
        row["why_unmeasured"] = f"{type(error).__name__}"
    torch.set_num_threads(1)
    if model_type in ARCHITECTURES:
        return {**row, "status": "exact", "reason": "adapter; exact against float64 in the tests"}
    if model_type in POST_LN:
        return {**row, "status": "refused", "reason": POST_LN[model_type]}
    if row["shift"] is not None and abs(row["shift"]) < 0.1:
        return {**row, "status": "refused", "reason": "post-LN: the first block's output does not move with its input"}
    measured = "pre-LN" if row["shift"] is not None and abs(row["shift"] - 1) < 0.1 else "not measured as pre-LN"
    return {**row, "status": "not yet", "reason": f"{measured} (shift {row['shift']}); no adapter"}


def table(rows: list[dict]) -> str:
    counts = {status: sum(row["status"] == status for row in rows) for status in ("exact", "refused", "not yet")}
    lines = [f"{counts['exact']} families exact, {counts['refused']} refused, {counts['not yet']} not yet "
             "(generated by `python3 scripts/audit_architectures.py`).", "",
             "| model type | status | first block's shift | reason |", "|---|---|---|---|"]
    for row in sorted(rows, key=lambda row: (("exact", "refused", "not yet").index(row["status"]), row["model_type"])):
        lines.append(f"| {row['model_type']} | {row['status']} | {row.get('shift')} | {row['reason']} |")
    return "\n".join(lines)


def write_docs(rows: list[dict], path: Path = DOCS) -> None:
    text = path.read_text(encoding="utf-8")
    block = f"{BEGIN}\n{table(rows)}\n{END}"
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n## Coverage audit\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    from transformers import CONFIG_MAPPING

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="*", help="model types to audit (default: every registered type)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/architectures.md")
    args = parser.parse_args(argv)
    rows = []
    for model_type in args.types or sorted(CONFIG_MAPPING.keys()):
        row = classify(model_type)
        if row["status"] is not None:
            rows.append(row)
            print(f"{model_type}: {row['status']} ({row.get('shift')}) {row['reason']}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.no_docs:
        write_docs(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
