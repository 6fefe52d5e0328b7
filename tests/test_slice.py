"""normswap rotate --slice: SliceGPT slicing with shortcut matrices, and block-wise calibration.

Fraction 0 keeps every dimension, so the sliced model must compute the original function: to
1e-9 · max|logit| with float64 weights, and within fp32 tolerance of the unsliced rotated model.
A real fraction is not exact; its perplexity cost must be measured and recorded. The stream's
second moments measured block by block must equal those of the whole model.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers import assert_no_layer_norm, causal_logits, load, make_hard, save, token_ids
from safetensors import safe_open
from test_bad_input import run_cli
from test_rotate import _files, _refused

import normswap
from normswap.api import rotate_checkpoint
from normswap.architectures import ARCHITECTURES
from normswap.architectures.spec import GPT2_SLICE_LAYOUT
from normswap.checkpoint.source import resolve_source
from normswap.errors import NormswapError
from normswap.modeling.remote import RMSNorm
from normswap.rotate import calibration, slicing
from normswap.rotate.slice_pipeline import SliceOptions, slice_checkpoint
from normswap.runtime.loaders import stock_refuses

BUNDLED = Path(normswap.__file__).parent / "data"
CALIBRATION = BUNDLED / "text" / "emma-excerpt.txt"
VOCAB = 2048  # the bundled tokenizer's


def _with_tokenizer(model: torch.nn.Module, path: Path) -> Path:
    src = save(make_hard(model).eval(), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(BUNDLED / "austen-gpt2" / name, src / name)
    return src


def tiny_gpt2(path: Path, **overrides) -> Path:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, **overrides)
    return _with_tokenizer(transformers.GPT2LMHeadModel(config), path)


@pytest.fixture(scope="module")
def gpt2_src(tmp_path_factory):
    return tiny_gpt2(tmp_path_factory.mktemp("src") / "gpt2")


@pytest.fixture(scope="module")
def sliced(gpt2_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("sliced") / "gpt2-sliced"
    return out, slice_checkpoint(gpt2_src, out, SliceOptions(fraction=0.25, calibration=CALIBRATION))


# ---------------------------------------------------------------------------------------------
# The math


def test_kept_dimension_and_fraction_checks():
    assert slicing.kept_dimension(128, 0.2) == 102 and slicing.kept_dimension(32, 0) == 32
    assert slicing.kept_dimension(4, 0.99) == 1
    for bad in (0, 1, 1.5, -0.1, float("nan"), True, "0.2"):
        with pytest.raises(NormswapError, match="--slice must be a fraction"):
            slicing.check_fraction(bad)
    assert slicing.check_fraction(0, allow_zero=True) == 0.0


def test_sliced_norm_keeps_the_full_width_statistic():
    """√(d/k)·RMSNorm_k with ε·d/k on the kept coordinates = RMSNorm_d of the zero-padded vector."""
    d, k, eps = 48, 30, 1e-5
    y = torch.randn(5, k, dtype=torch.float64)
    padded = torch.cat([y, torch.zeros(5, d - k, dtype=torch.float64)], -1)
    full = RMSNorm(d, eps=eps, weight=False, bias=False)(padded)[:, :k]
    norm = RMSNorm(k, eps=eps * d / k, bias=False).double()
    with torch.no_grad():
        norm.weight.fill_(math.sqrt(d / k))
        assert float((norm(y) - full).abs().max()) < 1e-14
        plain = RMSNorm(k, eps=eps, weight=False, bias=False)(y)  # the naive norm is off by √(k/d)
        assert float((plain - full).abs().max()) > 0.1


def test_stream_axes_generalise_the_block_index():
    roles = {"transformer.h.0.ln_1.weight": slicing.Role("norm_weight", 0, 0),
             "transformer.h.1.ln_1.weight": slicing.Role("norm_weight", 0, 2),
             "lm_head.weight": slicing.Role("reader", 1, 4)}
    axes = slicing.stream_axes(roles, GPT2_SLICE_LAYOUT)
    assert axes == [["lm_head\\.weight", 1], ["transformer\\.h\\.\\d+\\.ln_1\\.weight", 0]]


def test_sliced_write_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The sliced weights stream through the writer: the output tensors alive at once stay near
    the largest one, far below the model's size (collecting them all would hold the whole model)."""
    import weakref

    from normswap.checkpoint.source import CheckpointReader, read_config
    from normswap.convert import fold
    from normswap.convert.write import write_weights
    from normswap.rotate.plan import plan_rotation

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=8, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    src = save(transformers.GPT2LMHeadModel(config).eval(), tmp_path / "deep")
    live, peak = [0], [0]
    compute = fold.compute_tensor

    def counted(plan, read):
        value = compute(plan, read)
        live[0] += value.nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(value, lambda size=value.nbytes: live.__setitem__(0, live[0] - size))
        return value

    monkeypatch.setattr(fold, "compute_tensor", counted)
    layout = GPT2_SLICE_LAYOUT
    norms = slicing.signal_norms(layout, 8)
    bases = [torch.linalg.qr(torch.randn(32, 24, dtype=torch.float64))[0] for _ in norms]
    with CheckpointReader(src) as reader:
        rotation_plan = plan_rotation(src, read_config(src), reader, dtype=None)
        roles = slicing.tensor_roles(list(rotation_plan.plan.tensors), rotation_plan.architecture, layout, norms)
        plan = slicing.sliced_plan(rotation_plan.plan, roles, bases, slicing.shortcut_tensors(layout, bases, 8),
                                   torch.float32, 32)
        write_weights(tmp_path, plan, reader)
    model_bytes = sum(tensor.nbytes for tensor in plan.tensors.values())
    largest = max(tensor.nbytes for tensor in plan.tensors.values())
    assert peak[0] <= 2 * largest < model_bytes / 10, (peak[0], largest, model_bytes)
    with safe_open(tmp_path / "model.safetensors", "pt") as written:
        assert tuple(written.get_tensor("transformer.h.0.mlp.c_fc.weight").shape) == (24, 128)


# ---------------------------------------------------------------------------------------------
# Exactness at fraction 0


def test_fraction_zero_is_exact_in_float64(gpt2_src, tmp_path):
    out = tmp_path / "zero"
    block = slice_checkpoint(gpt2_src, out, SliceOptions(fraction=0, calibration=CALIBRATION, dtype="float64", allow_zero=True))
    assert block["slicing"]["hidden_size"] == 32
    ids = token_ids(VOCAB)
    reference = causal_logits(load(gpt2_src, "original", torch.float64), ids)
    scale = max(1.0, float(reference.abs().max()))
    for how in ("remote", "normswap"):
        error = float((causal_logits(load(out, how, torch.float64), ids) - reference).abs().max())
        assert error < 1e-9 * scale, f"{how}: max |Δ| = {error:.3g}"


@pytest.mark.slow
def test_fraction_zero_matches_the_rotated_model_in_float32(gpt2_src, tmp_path):
    rotated, zero = tmp_path / "rotated", tmp_path / "zero"
    rotate_checkpoint(gpt2_src, rotated, method="pca", calibration=CALIBRATION, verification="none")
    slice_checkpoint(gpt2_src, zero, SliceOptions(fraction=0, calibration=CALIBRATION, allow_zero=True))
    ids = token_ids(VOCAB)
    expected = causal_logits(load(rotated, "remote", torch.float32), ids)
    got = causal_logits(load(zero, "remote", torch.float32), ids)
    assert float((got - expected).abs().max()) < 1e-4 * max(1.0, float(expected.abs().max()))


@pytest.mark.slow
def test_gpt_neo_slices_exactly_at_fraction_zero(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, intermediate_size=64,
                                       max_position_embeddings=64, attention_types=[[["global", "local"], 1]],
                                       window_size=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    src = _with_tokenizer(transformers.GPTNeoForCausalLM(config), tmp_path / "neo")
    out = tmp_path / "neo-zero"
    slice_checkpoint(src, out, SliceOptions(fraction=0, calibration=CALIBRATION, dtype="float64", allow_zero=True))
    ids = token_ids(VOCAB)
    reference = causal_logits(load(src, "original", torch.float64), ids)
    error = float((causal_logits(load(out, "remote", torch.float64), ids) - reference).abs().max())
    assert error < 1e-9 * max(1.0, float(reference.abs().max()))
    sliced = slice_checkpoint(src, tmp_path / "neo-half", SliceOptions(fraction=0.5, calibration=CALIBRATION))
    assert sliced["slicing"]["hidden_size"] == 16 and math.isfinite(sliced["slicing"]["perplexity"]["sliced"])


# ---------------------------------------------------------------------------------------------
# The sliced checkpoint


def test_sliced_checkpoint_loads_both_ways(sliced):
    out, provenance = sliced
    block = provenance["slicing"]
    assert block["fraction"] == 0.25 and block["hidden_size"] == 24 and block["original_hidden_size"] == 32
    assert block["exact"] is False
    assert len(block["calibration"]["text_sha256"]) == 64 and block["calibration"]["measured"] == "blockwise"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "normswap_gpt2" and config["normswap"]["slicing"] == block
    assert config["layer_norm_epsilon"] == pytest.approx(1e-5 * 32 / 24)
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert weights.get_slice("transformer.wte.weight").get_shape() == [VOCAB, 24]
        for index in range(2):
            for branch in ("attn", "mlp"):
                assert weights.get_slice(f"transformer.h.{index}.shortcut_{branch}.weight").get_shape() == [24, 24]
    ids = token_ids(VOCAB)
    logits = []
    for how in ("remote", "normswap"):
        model = load(out, how, torch.float32)
        assert_no_layer_norm(model)
        assert model.transformer.wte.weight.shape == (VOCAB, 24)
        logits.append(causal_logits(model, ids))
    assert torch.equal(logits[0], logits[1])
    assert stock_refuses(out)  # the own model type: stock transformers refuses it


@pytest.mark.slow
def test_folded_source_slices_like_the_original(gpt2_src, sliced, tmp_path):
    folded, out = tmp_path / "folded", tmp_path / "from-folded"
    normswap.convert_checkpoint(gpt2_src, folded, fold_gains=True, verification="none")
    block = slice_checkpoint(folded, out, SliceOptions(fraction=0.25, calibration=CALIBRATION))["slicing"]
    assert block["hidden_size"] == 24 and block["calibration"] == sliced[1]["slicing"]["calibration"]
    ids = token_ids(VOCAB)
    expected = causal_logits(load(sliced[0], "remote", torch.float32), ids)
    got = causal_logits(load(out, "remote", torch.float32), ids)
    assert float((got - expected).abs().max()) < 1e-3 * max(1.0, float(expected.abs().max()))


def test_perplexity_cost_is_printed_and_recorded(gpt2_src, tmp_path, capsys):
    out = tmp_path / "cli"
    held_out = tmp_path / "held-out.txt"
    held_out.write_text(CALIBRATION.read_text()[:2000])
    code, _ = run_cli(capsys, "rotate", str(gpt2_src), "--out", str(out), "--slice", "0.5",
                      "--calibration", str(CALIBRATION), "--held-out", str(held_out))
    assert code == 0
    cost = json.loads((out / "config.json").read_text())["normswap"]["slicing"]["perplexity"]
    assert math.isfinite(cost["original"]) and math.isfinite(cost["sliced"]) and cost["tokens"] > 100
    assert cost["increase"] == pytest.approx(cost["sliced"] / cost["original"] - 1)
    assert "NOT exact" in (out / "README.md").read_text()


def test_cli_says_slicing_is_not_exact(gpt2_src, tmp_path, capsys):
    from normswap.cli import main

    assert main(["rotate", str(gpt2_src), "--out", str(tmp_path / "o"), "--slice", "0.25",
                 "--calibration", str(CALIBRATION)]) == 0
    printed = capsys.readouterr().out
    assert "NOT exact" in printed and "perplexity" in printed and "(original)" in printed and "32 to 24" in printed


def test_slicing_is_deterministic(gpt2_src, sliced, tmp_path):
    again = tmp_path / "again"
    slice_checkpoint(gpt2_src, again, SliceOptions(fraction=0.25, calibration=CALIBRATION))
    assert _files(again) == _files(sliced[0])


# ---------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--slice", "0", "--calibration", str(CALIBRATION)), ("--slice must be a fraction",)),
        (("--slice", "1", "--calibration", str(CALIBRATION)), ("--slice must be a fraction",)),
        (("--slice", "-0.2", "--calibration", str(CALIBRATION)), ("--slice must be a fraction",)),
        (("--slice", "nan", "--calibration", str(CALIBRATION)), ("--slice must be a fraction",)),
        (("--slice", "0.2"), ("needs --calibration",)),
        (("--slice", "0.2", "--method", "hadamard", "--calibration", str(CALIBRATION)), ("--method hadamard",)),
        (("--held-out", str(CALIBRATION)), ("only used with --slice",)),
        (("--slice", "0.2", "--calibration", str(CALIBRATION), "--verify", "full"), ("not exact",)),
        (("--slice", "0.2", "--calibration", "/nonexistent.txt"), ("calibration text not found",)),
        (("--slice", "0.001", "--calibration", str(CALIBRATION)), ("deletes 0 of the stream's 32 dimensions",)),
    ],
)
def test_refuses_bad_slice_options(tmp_path, capsys, gpt2_src, args, needles):
    _refused(tmp_path, capsys, str(gpt2_src), *args, needles=needles)


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (b"\xff\xfe\x00 not utf-8", ("is not UTF-8",)),
        (b"one two three four five six seven eight nine ten " * 2, ("fewer than the stream's 32 dimensions",)),
    ],
)
def test_refuses_unusable_calibration_text(tmp_path, capsys, gpt2_src, text, needles):
    calibration_file = tmp_path / "calibration.txt"
    calibration_file.write_bytes(text)
    _refused(tmp_path, capsys, str(gpt2_src), "--slice", "0.2", "--calibration", str(calibration_file), needles=needles)


def test_refuses_too_few_held_out_tokens(tmp_path, capsys, gpt2_src):
    held_out = tmp_path / "held-out.txt"
    held_out.write_text("the end")
    _refused(tmp_path, capsys, str(gpt2_src), "--slice", "0.2", "--calibration", str(CALIBRATION),
             "--held-out", str(held_out), needles=("held-out tokens",))


def test_refuses_unsupported_family(tmp_path, capsys):
    torch.manual_seed(0)
    config = transformers.OPTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, ffn_dim=64,
                                    max_position_embeddings=32, vocab_size=VOCAB, word_embed_proj_dim=32)
    src = _with_tokenizer(transformers.OPTForCausalLM(config), tmp_path / "opt")
    _refused(tmp_path, capsys, str(src), "--slice", "0.2", "--calibration", str(CALIBRATION),
             needles=("cannot slice a opt checkpoint", "gpt2"))


def test_refuses_cross_attention(tmp_path, capsys):
    src = tiny_gpt2(tmp_path / "cross", add_cross_attention=True)
    _refused(tmp_path, capsys, str(src), "--slice", "0.2", "--calibration", str(CALIBRATION),
             needles=("cross-attention",))


def test_refuses_already_sliced_source(tmp_path, capsys, sliced):
    _refused(tmp_path, capsys, str(sliced[0]), "--slice", "0.2", "--calibration", str(CALIBRATION),
             needles=("already sliced",))
    _refused(tmp_path, capsys, str(sliced[0]), needles=("already sliced",))


def test_verify_says_a_sliced_checkpoint_is_not_exact(capsys, gpt2_src, sliced):
    code, err = run_cli(capsys, "verify", str(gpt2_src), str(sliced[0]))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert "is sliced (32 → 24 dimensions), which is not exact" in lines[0]


def test_refuses_rotated_source(tmp_path, capsys, gpt2_src):
    rotated = tmp_path / "rotated"
    rotate_checkpoint(gpt2_src, rotated, method="hadamard", verification="none")
    _refused(tmp_path, capsys, str(rotated), "--slice", "0.2", "--calibration", str(CALIBRATION),
             needles=("already rotated",))


# ---------------------------------------------------------------------------------------------
# Calibration block by block


@pytest.mark.parametrize("source", ["original", "folded"])
def test_blockwise_calibration_equals_whole_model(tmp_path, source):
    src = resolve_source("normswap:austen-gpt2")
    if source == "folded":
        src = tmp_path / "folded"
        normswap.convert_checkpoint("normswap:austen-gpt2", src, fold_gains=True, verification="none")
    architecture = ARCHITECTURES["gpt2"]
    norms = slicing.signal_norms(GPT2_SLICE_LAYOUT, 4)
    ids = calibration.calibration_ids(src, CALIBRATION.read_text(), "emma")[:700]
    blockwise = calibration.blockwise_moments(src, architecture, norms, ids, 256, torch.device("cpu"))
    whole = calibration.whole_moments(src, architecture, norms, ids, 256)
    assert (blockwise.mode, whole.mode, blockwise.window) == ("blockwise", "whole", 256)
    for name in norms:
        scale = float(whole.moments[name].abs().max())
        assert float((blockwise.moments[name] - whole.moments[name]).abs().max()) <= 1e-12 * scale, name


def test_calibration_windows_fit_every_family_position_limit():
    with torch.device("meta"):
        mpt = transformers.MptForCausalLM(transformers.MptConfig(d_model=32, n_layers=1, n_heads=4, max_seq_len=64,
                                                                 vocab_size=128))
    assert calibration.window_for(mpt, 512) == 64  # MPT names its limit max_seq_len
