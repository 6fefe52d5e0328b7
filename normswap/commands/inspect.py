"""``normswap inspect SRC``: print the conversion plan; writes nothing."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from normswap.checkpoint.source import CheckpointReader, read_config, resolve_source
from normswap.commands import add_json_option, emit_json

if TYPE_CHECKING:
    from normswap.convert.plan import ConversionPlan


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="hub id, local checkpoint directory, or normswap:austen-gpt2")
    parser.add_argument("--fold-gains", action="store_true", help="plan with gain folding")
    add_json_option(parser)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="no effect: inspect never runs code from a checkpoint")


def run(args: argparse.Namespace) -> int:
    path = resolve_source(args.src, trust_remote_code=args.trust_remote_code)
    config = read_config(path)
    from normswap.convert.planning import check_convertible, plan_conversion

    # a refusal is one line on stderr and exit 2, as for every command
    architecture = check_convertible(path, config)  # before opening any weight file
    with CheckpointReader(path) as reader:  # the class is built only when the adapter declares no facts for it
        _, plan, _ = plan_conversion(path, config, reader, method="exact", fold_gains=args.fold_gains, dtype=None,
                                     architecture=architecture, build_class=False)
    if args.json:
        emit_json(args, plan_as_dict(plan))
        return 0
    print(f"checkpoint: {path}")
    print(f"architecture: {config.get('model_type')} ({', '.join(config.get('architectures') or ['?'])})")
    print("exact conversion: possible")
    stored = stored_names(plan)
    print(f"norms ({len(plan.norms)}):")
    for norm in plan.norms:
        readers = ", ".join(stored.get(name, name) for name in norm.readers) or "-"
        detail = f"baked into {norm.baked_into}" if norm.baked_into else f"read by {readers}"
        fold = ""
        if args.fold_gains:
            fold = " [gains folded" + (", keeps β/γ" if norm.kept_bias else "") + "]" if norm.folded_gain else f" [not folded: {norm.note}]"
        print(f"  {_module(stored, norm.name)}: {detail}{fold}")
    print(f"tensors to centre ({len(plan.writers)}):")
    for name in plan.writers:
        print(f"  {stored.get(name, name)}")
    print("tied head: " + (", ".join(f"{head} untied from {stored.get(emb, emb)}" for head, emb in plan.untied)
                           or "not tied"))
    if plan.renamed:
        print(f"written under transformers' names ({len(plan.renamed)} tensors renamed): "
              + ", ".join(f"{old} -> {new}" for old, new in list(plan.renamed.items())[:3])
              + (", …" if len(plan.renamed) > 3 else ""))
    if plan.structure:
        print(f"structural changes: {plan.structure}")
    if plan.dropped:
        print(f"dropped (buffers rebuilt by transformers): {len(plan.dropped)}")
    return 0


def stored_names(plan: ConversionPlan) -> dict[str, str]:
    """Each renamed tensor's name in the plan (transformers' current name, which the output is
    written under) -> the name the checkpoint's files hold."""
    return {new: old for old, new in plan.renamed.items()}


def _module(stored: dict[str, str], module: str) -> str:
    """A module's path as the checkpoint's files name it (read off its weight's stored name)."""
    name = stored.get(f"{module}.weight")
    return module if name is None else name.removesuffix(".weight")


def plan_as_dict(plan: ConversionPlan) -> dict:
    """The plan as JSON-ready data: its summary, the norms, the centred writers, each tensor's steps."""
    return {
        **plan.summary(),
        "norms": [vars(norm) for norm in plan.norms],
        "writers": plan.writers,
        "renamed": plan.renamed,
        "tensors": {name: [type(step).__name__ for step in tensor.steps] for name, tensor in plan.tensors.items()},
    }
