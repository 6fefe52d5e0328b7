"""How exact `normswap rotate` is, per family, method and form, in float64.

For a tiny GPT-2, the first test model of every causal family in tests/test_architectures_causal.py (made
"hard" by tests/helpers.make_hard: γ far from 1, β far from 0, a massive dimension), the per-head q/k
norm models of tests/test_architectures_more.py (StableLM, Persimmon, Cohere) and for Whisper,
ViT (ViTForImageClassification) and CLIP (CLIPModel), each method (hadamard, orthogonal, pca: on the
bundled Emma excerpt for the causal ones, on `bundled` for the encoders: Whisper's six transcribed
utterances, ViT's six images, the Persuasion excerpt through CLIP's text tower) in each form: the rotation is written with float64
weights and loaded back, the commuting form with the stock class (no remote code), the free form
with normswap.load (the RMSNorm model); the figure is max|Δoutput| / max|output| against the float64
original (logits; for CLIP logits_per_image and both embeddings); and the free Hadamard rotation
with the online Hadamard at the MLP down projections (``--online-hadamard``). A form or method a
family does not support is reported with the refusal's reason.

    python3 scripts/rotation_exactness.py [--out benchmarks/results/rotation_exactness.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import transformers as T  # noqa: E402
from helpers import make_hard, save, token_ids  # noqa: E402
from test_architectures_causal import CASES, VOCAB, _family  # noqa: E402
from test_architectures_more import CAUSAL, make_harder  # noqa: E402
from test_rotate_commuting import calibratable_encoders, with_processors  # noqa: E402

import normswap  # noqa: E402
from normswap.api import rotate_checkpoint  # noqa: E402
from normswap.errors import NormswapError  # noqa: E402

CALIBRATION = ROOT / "normswap" / "data" / "text" / "emma-excerpt.txt"
# calibrated on the bundled samples of what they read: transcribed speech, images, text (CLIP)
ENCODERS = ("whisper", "vit", "clip")
TOKENIZER = ROOT / "normswap" / "data" / "austen-gpt2"


GPT2 = {"gpt2": lambda: T.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)}
# per-head q/k norms (made hard by make_harder, which reaches the families' own norm classes)
QK_NORMS = {case: CAUSAL[case] for case in ("stablelm-qk-norm", "persimmon", "cohere-qk-norm")}


def _causal(case: str, folder: Path):
    torch.manual_seed(0)
    config = {**GPT2, **CASES, **QK_NORMS}[case]()
    config.vocab_size = 2048  # the bundled tokenizer's ids, for pca calibration
    hard = make_harder if case in QK_NORMS else make_hard
    src = save(hard(T.AutoModelForCausalLM.from_config(config)).eval(), folder / case)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((TOKENIZER / name).read_bytes())
    ids = token_ids(VOCAB)
    return src, T.AutoModelForCausalLM, lambda model: model(input_ids=ids).logits


def _encoders(folder: Path) -> dict:
    built = {}
    for name, (build, auto, forward) in calibratable_encoders().items():
        torch.manual_seed(0)
        built[name] = (with_processors(save(make_hard(build()).eval(), folder / name), name), getattr(T, auto), forward)
    return built


# (form, method, online Hadamard at the MLP down projections)
RUNS = [(form, method, False) for form in ("commuting", "free") for method in ("hadamard", "orthogonal", "pca")]
RUNS.append(("free", "hadamard", True))


def _key(form: str, method: str, online: bool) -> str:
    return f"{form} {method}" + (" + online Hadamard" if online else "")


def _run(name: str, src: Path, auto, forward, scratch: Path, form: str, method: str, online: bool) -> float | str:
    """The relative error of one rotation of ``src``, or the refusal's reason."""
    out = scratch / f"{name}-{_key(form, method, online).replace(' ', '-')}"
    calibration = (CALIBRATION if name not in ENCODERS else "bundled") if method == "pca" else None
    try:
        rotate_checkpoint(src, out, method=method, form=form, seed=3, dtype=torch.float64, verification="none",
                          calibration=calibration, online_hadamard=online)
    except NormswapError as error:
        return f"refused: {str(error)[:90]}"
    return relative_error(src, auto, forward, out, form)


@torch.no_grad()
def relative_error(src: Path, auto, forward, out: Path, form: str) -> float:
    reference = forward(auto.from_pretrained(src, dtype=torch.float64).eval()).double()
    model = auto.from_pretrained(out, dtype=torch.float64) if form == "commuting" else normswap.load(out, dtype=torch.float64)
    return float((forward(model.eval()).double() - reference).abs().max() / reference.abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rotation_exactness.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        firsts = {"gpt2": "gpt2"}
        for case in (*CASES, *QK_NORMS):
            firsts.setdefault(case if case in QK_NORMS else _family(case), case)
        sources = {case: _causal(case, scratch) for case in firsts.values()} | _encoders(scratch)
        for name, (src, auto, forward) in sources.items():
            row = {"model": name}
            for form, method, online in RUNS:
                row[_key(form, method, online)] = _run(name, src, auto, forward, scratch, form, method, online)
            rows.append(row)
            print(json.dumps(row), flush=True)
    keys = [_key(*run) for run in RUNS]
    print("\n| model | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for row in rows:
        cells = [f"{row[key]:.1e}" if isinstance(row[key], float) else "refused" for key in keys]
        print(f"| {row['model']} | " + " | ".join(cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"dtype": "float64", "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
