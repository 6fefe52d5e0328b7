"""The weights proof's power: for every tensor kind of every family's test model, a single-element
change, a mean-free pair in one row and a row swap each fail the proof, and a change of one unit in
the last place of the stored dtype (what rounding may do) passes.

The kinds: embedding and position rows outside the forward probe, residual writers, folded
readers, untouched readers, norm gains and biases, the head (plain and ``--fold-gains``
conversions of every family), rotated writers and readers and the rotation matrix (GPT-2
rotation), the slicing shortcut (GPT-2 slicing). The parametrised cases run the proof alone,
through ``normswap.prove_checkpoint`` (no forward pass); one case runs ``normswap verify``
end to end on the bundled model with the tampering a forward probe cannot see.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_every_command import FAMILIES, build

import normswap
from normswap.checkpoint.source import example_model_path
from normswap.cli import main
from normswap.convert.steps import Centre, DivideByGain, FoldBias, FoldGain
from normswap.errors import NormswapError, VerificationError
from normswap.verify.probes import PROBE_TOKENS

MUTATIONS = ("single", "mean_free_pair", "row_swap", "one_ulp")
HEADS = re.compile(r"(lm_head|embed_out|proj_out|classifier|.*projection)\.weight")


def _kinds(plan) -> dict[str, str]:
    """One tensor name per kind the conversion ``plan`` makes (the first of each, in name order)."""
    norms = {norm.name for norm in plan.norms}
    found: dict[str, str] = {}
    for name, tensor in plan.tensors.items():
        steps = {type(step) for step in tensor.steps}
        module, _, leaf = name.rpartition(".")
        if HEADS.fullmatch(name) and tensor.shape[-1] > 1:
            kind = "head"
        elif module in norms:
            kind = f"norm_{leaf}"
        elif Centre in steps and re.search(r"wpe|position", name) and tensor.shape[0] > PROBE_TOKENS:
            kind = "position_rows"
        elif Centre in steps and re.search(r"wte|embed|word_embeddings", name) and tensor.shape[0] > PROBE_TOKENS:
            kind = "embedding_rows"
        elif Centre in steps:
            kind = "writer"
        elif steps & {FoldGain, FoldBias, DivideByGain}:
            kind = "folded_reader"
        elif not steps and tensor.dtype.is_floating_point and len(tensor.shape) >= 2:
            kind = "untouched_reader"
        else:
            continue
        found.setdefault(kind, name)
    return found


def _mutated(value: torch.Tensor, how: str, row: int) -> torch.Tensor | None:
    """``value`` with the mutation ``how`` at ``row`` (its last row for a table), or None when the
    mutation cannot change this tensor (a row swap of a constant tensor)."""
    out = value.clone()
    rows = out.reshape(out.shape[0], -1) if out.dim() >= 2 else out.reshape(1, -1)
    row = row if out.dim() >= 2 else 0
    delta = 0.05 * float(value.abs().max()) or 0.05
    if how == "single":
        rows[row, 0] += delta
    elif how == "mean_free_pair":
        rows[row, 0] += delta
        rows[row, 1] -= delta
    elif how == "one_ulp":
        rows[row, 0] = torch.nextafter(rows[row, 0], torch.tensor(float("inf"), dtype=out.dtype))
    else:  # swap with the first row (element, for a vector) that differs
        line = rows if rows.shape[0] > 1 else rows.T
        index = row if rows.shape[0] > 1 else 0
        other = next((j for j in range(line.shape[0]) if not torch.equal(line[j], line[index])), None)
        if other is None:
            return None
        line[[index, other]] = line[[other, index]]
    return out


def _passes(prove, error: type[Exception] = VerificationError, *, restore: list[tuple[Path, bytes]]) -> bool:
    """Whether ``prove()`` passes (False when it raises ``error``); the files are restored after."""
    try:
        prove()
        return True
    except error:
        return False
    finally:
        for path, content in restore:
            path.write_bytes(content)


def _escapes(original: Path, converted: Path, names: dict[str, str], copied: set[str] = frozenset()) -> list[str]:
    """Every mutation of every named tensor that the proof gets wrong (empty when it has full power).

    A one-ulp change must pass where the tensor was computed and rounded; a tensor in ``copied``
    is the source's bytes, which nothing rounds, so there it must fail too."""
    weights = converted / "model.safetensors"
    pristine = weights.read_bytes()
    state = load_file(weights)
    wrong = []
    for kind, name in names.items():
        row = state[name].shape[0] - 1 if kind.endswith("_rows") else 0
        for how in MUTATIONS:
            changed = _mutated(state[name], how, row)
            if changed is None:
                continue
            save_file({**state, name: changed}, weights, metadata={"format": "pt"})
            passed = _passes(lambda: normswap.prove_checkpoint(original, converted), restore=[(weights, pristine)])
            if passed != (how == "one_ulp" and name not in copied):
                wrong.append(f"{kind} {name} {how}: {'passed' if passed else 'failed'}")
    return wrong


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    def source(family: str) -> Path:
        if not (root / family).exists():
            build(family, root / family)  # (path, the command-line option for its input kind)
        return root / family

    return source


def _plan_of(converted: Path, original: Path):
    from normswap.verify.checkpoint import stored_tensors
    from normswap.verify.proof import rebuilt_conversion_plan

    config = json.loads((original / "config.json").read_text())
    options = json.loads((converted / "config.json").read_text())["normswap"]["options"]
    return rebuilt_conversion_plan(original, config, options, stored_tensors(converted))


# GPT-2 is in the quick loop (-m "not slow"); the other families are slow.
@pytest.mark.parametrize("fold_gains", [False, True], ids=["plain", "fold"])
@pytest.mark.parametrize("family", [f if f == "gpt2" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_every_injected_error_fails_the_proof(family, fold_gains, sources, tmp_path):
    src = sources(family)
    out = tmp_path / "out"
    normswap.convert_checkpoint(src, out, fold_gains=fold_gains, verification="none")
    assert normswap.prove_checkpoint(src, out)["worst"]["ulp"] <= 1
    plan = _plan_of(out, src)
    names = _kinds(plan)
    gains = any(f"{norm.name}.weight" in plan.tensors for norm in plan.norms)  # OLMo's norms hold none
    expected = {"writer"} | ({"norm_weight"} if gains else set())
    expected.add("folded_reader" if fold_gains and gains else "untouched_reader")
    assert expected <= set(names), names
    copied = {name for name, tensor in plan.tensors.items() if not tensor.steps}
    assert _escapes(src, out, names, copied) == []


def test_rotated_tensors_and_the_rotation_matrix(sources, tmp_path):
    src = sources("gpt2")
    out = tmp_path / "rotated"
    normswap.rotate_checkpoint(src, out, method="orthogonal", seed=3, verification="none")
    assert normswap.prove_checkpoint(src, out)["recomputed"] > 0
    names = {"rotated_writer": "transformer.h.0.mlp.c_proj.weight", "rotated_reader": "transformer.h.1.attn.c_attn.weight",
             "rotated_embedding_rows": "transformer.wte.weight", "rotated_head": "lm_head.weight"}
    assert _escapes(src, out, names) == []
    file, config_file = out / "normswap_rotation.record", out / "config.json"
    pristine, config = file.read_bytes(), config_file.read_text()
    q = load_file(file)["rotation"]
    for how in MUTATIONS:
        changed = _mutated(q, how, 0)
        save_file({"rotation": changed}, file)
        # the recorded hash follows the file, as a writer that stored the wrong Q would record it
        block = json.loads(config)
        block["normswap"]["rotation"]["matrix_sha256"] = hashlib.sha256(changed.contiguous().numpy().tobytes()).hexdigest()
        config_file.write_text(json.dumps(block))
        passed = _passes(lambda: normswap.prove_checkpoint(src, out), NormswapError,
                         restore=[(file, pristine), (config_file, config.encode())])
        assert passed == (how == "one_ulp"), how


def test_the_slicing_shortcut(sources, tmp_path):
    from normswap.rotate.slice_pipeline import SliceOptions, slice_checkpoint
    from normswap.verify.proof import WrittenProof, prove_weights

    src = sources("gpt2")
    out = tmp_path / "sliced"
    calibration = example_model_path().parent / "text" / "persuasion-excerpt.txt"
    planned = {}

    def prover(plan):
        planned["plan"] = plan
        return WrittenProof(plan)

    block = slice_checkpoint(src, out, SliceOptions(0.25, calibration, calibration_tokens=2048), prover=prover)
    assert block["slicing"]["proof"]["tensors"] == len(planned["plan"].tensors)
    weights = out / "model.safetensors"
    pristine, state = weights.read_bytes(), load_file(weights)
    for name in ("transformer.h.0.shortcut_attn.weight", "transformer.wte.weight"):
        for how in MUTATIONS:
            row = state[name].shape[0] - 1
            save_file({**state, name: _mutated(state[name], how, row)}, weights, metadata={"format": "pt"})
            passed = _passes(lambda: prove_weights(src, out, planned["plan"]), restore=[(weights, pristine)])
            assert passed == (how == "one_ulp"), (name, how)


@pytest.mark.slow
def test_verify_fails_on_rows_no_probe_reads(tmp_path, capsys):
    """The bundled model, converted; a mean-free change in token 1777's embedding row, then in
    position 250's row: ``normswap verify`` exits 3 naming the element."""
    out = tmp_path / "rms"
    assert main(["convert", "normswap:austen-gpt2", "--out", str(out), "--quiet"]) == 0
    weights = out / "model.safetensors"
    pristine = weights.read_bytes()
    for name, row in (("transformer.wte.weight", 1777), ("transformer.wpe.weight", 250)):
        state = load_file(weights)
        delta = 0.05 * float(state[name].abs().max())
        state[name][row, 0] += delta
        state[name][row, 1] -= delta
        save_file(state, weights, metadata={"format": "pt"})
        capsys.readouterr()
        assert main(["verify", "normswap:austen-gpt2", str(out)]) == 3
        assert f"weights proof: {name}[{row}, 0]" in capsys.readouterr().err
        weights.write_bytes(pristine)
    assert main(["verify", "normswap:austen-gpt2", str(out)]) == 0
    assert "weights proven: 53 tensors" in capsys.readouterr().out
    shutil.rmtree(out)


def test_non_finite_values_and_a_wrong_inventory_are_named(sources, tmp_path):
    src = sources("gpt2")
    out = tmp_path / "out"
    normswap.convert_checkpoint(src, out, verification="none")
    weights = out / "model.safetensors"
    pristine, state = weights.read_bytes(), load_file(weights)
    writer = "transformer.h.0.attn.c_proj.weight"
    nan = state[writer].clone()
    nan[3, 4] = float("nan")
    cases = {
        r"c_proj\.weight\[3, 4\] is nan, .* not finite": {**state, writer: nan},
        r"has a tensor the conversion does not make: extra": {**state, "extra": torch.zeros(2)},
        r"lacks the tensor transformer\.h\.0\.attn\.c_proj\.bias": {
            name: value for name, value in state.items() if name != "transformer.h.0.attn.c_proj.bias"},
        r"c_proj\.weight is stored as float16": {**state, writer: state[writer].half()},
    }
    for message, changed in cases.items():
        save_file(changed, weights, metadata={"format": "pt"})
        with pytest.raises(VerificationError, match=message):
            normswap.prove_checkpoint(src, out)
        weights.write_bytes(pristine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_cast_conversion_is_proven_in_its_own_rounding(sources, tmp_path, dtype):
    """``--dtype`` shows in the stored dtypes, so the rebuilt plan casts as the conversion did; one
    ulp of the narrow dtype passes, two fail."""
    src = sources("gpt2")
    out = tmp_path / "out"
    normswap.convert_checkpoint(src, out, fold_gains=True, dtype=dtype, verification="none")
    assert normswap.prove_checkpoint(src, out)["recomputed"] == len(load_file(out / "model.safetensors"))
    weights = out / "model.safetensors"
    pristine, state = weights.read_bytes(), load_file(weights)
    name = "transformer.h.1.mlp.c_proj.weight"
    for steps, passes in ((1, True), (2, False)):
        changed = state[name].clone()
        for _ in range(steps):
            changed[5, 7] = torch.nextafter(changed[5, 7], torch.tensor(float("inf"), dtype=changed.dtype))
        save_file({**state, name: changed}, weights, metadata={"format": "pt"})
        assert _passes(lambda: normswap.prove_checkpoint(src, out), restore=[(weights, pristine)]) == passes


def test_a_value_the_output_dtype_cannot_hold_fails(sources, tmp_path, capsys):
    """A finite float32 value beyond float16's range becomes infinite in a --dtype float16 conversion:
    the proof names it, though the infinity equals the plan's value rounded to float16."""
    src = tmp_path / "src"
    shutil.copytree(sources("gpt2"), src)
    state = load_file(src / "model.safetensors")
    state["transformer.wpe.weight"][60, 3] = 1e5
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["convert", str(src), "--out", str(tmp_path / "out"), "--dtype", "float16", "--quiet"]) == 3
    error = capsys.readouterr().err.strip()
    assert "transformer.wpe.weight[60, 3]" in error and "becomes infinite" in error and "\n" not in error
    assert not (tmp_path / "out").exists()
