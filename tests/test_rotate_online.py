"""rotate --form free --online-hadamard: H at every MLP down projection's input, at run time.

The structured transform equals x·H/√n for the Hadamard matrices normswap builds (non-powers of
two included); the rotated model with the online Hadamard is exact in float64 through the
checkpoint's own code and ``normswap.load``, its down projections are stored as W·H (the
weights proof rebuilds them), and it is refused where it cannot apply.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from helpers import causal_logits, load, make_hard, save, token_ids
from safetensors.torch import load_file
from test_architectures_causal import CASES
from test_bad_input import assert_one_line_error, run_cli

from normswap.api import rotate_checkpoint
from normswap.modeling import hadamard
from normswap.modeling.remote import hadamard_transform

VOCAB = 61


@pytest.mark.parametrize("n", [2, 12, 48, 200, 768, pytest.param(3072, marks=pytest.mark.slow)])
def test_structured_transform_is_the_hadamard_matrix(n):
    twos, factor = hadamard.kronecker_split(n)
    assert factor.shape[0] * 2**twos == n
    x = torch.randn(3, 2, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dense = x @ (hadamard.hadamard_matrix(n).double() / n**0.5)
    assert torch.allclose(hadamard_transform(x, factor, twos), dense, atol=1e-12)
    assert torch.allclose(hadamard_transform(x.float(), factor, twos).double(), dense, atol=1e-5)


def _gpt2(inner: int):
    return T.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, n_inner=inner, vocab_size=VOCAB,
                        bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("case", ["gpt2-inner-48", pytest.param("opt-tied", marks=pytest.mark.slow)])
def test_online_hadamard_is_exact_and_stored_as_w_h(tmp_path, case):
    """GPT-2 with d_ff = 48 = 2²·12 (Conv1D c_proj, a Paley factor) and OPT (nn.Linear fc2)."""
    torch.manual_seed(0)
    config = _gpt2(48) if case.startswith("gpt2") else CASES[case]()
    src = save(make_hard(T.AutoModelForCausalLM.from_config(config)).eval(), tmp_path / "src")
    ids = token_ids(VOCAB)
    reference = causal_logits(load(src, "original", torch.float64), ids)
    plain, online = tmp_path / "plain", tmp_path / "online"
    rotate_checkpoint(src, plain, form="free", dtype=torch.float64, verification="none")
    block = rotate_checkpoint(src, online, form="free", online_hadamard=True, dtype=torch.float64,
                              verification="none")
    spec = block["rotation"]["online_hadamard"]
    assert len(spec["modules"]) == 2 and spec["size"] == (48 if case.startswith("gpt2") else 64)
    for how in ("remote", "normswap"):
        error = float((causal_logits(load(online, how, torch.float64), ids) - reference).abs().max())
        assert error <= 1e-9 * max(1.0, float(reference.abs().max())), (how, error)
    # the stored weight is the plain rotation's with H on its input axis; the rest is unchanged
    h = hadamard.hadamard_matrix(spec["size"]).double() / spec["size"] ** 0.5
    before, after = load_file(plain / "model.safetensors"), load_file(online / "model.safetensors")
    name = next(n for n in before if n.endswith((".mlp.c_proj.weight", ".fc2.weight")))
    expected = h.T @ before[name] if name.endswith("c_proj.weight") else before[name] @ h
    assert torch.allclose(after[name], expected, atol=1e-12)
    assert all(torch.equal(before[n], after[n]) for n in before if not n.endswith((".mlp.c_proj.weight", ".fc2.weight")))
    # float32 with built-in verification: the weights proof rebuilds the step, the forwards agree
    block = rotate_checkpoint(src, tmp_path / "fp32", form="free", online_hadamard=True, verification="full")
    assert block["verification"]["passed"] and block["verification"]["proof"]["recomputed"] > 0


def test_a_tampered_record_is_refused_by_verify(tmp_path, capsys):
    torch.manual_seed(0)
    src = save(make_hard(T.GPT2LMHeadModel(_gpt2(48))).eval(), tmp_path / "src")
    out = tmp_path / "online"
    rotate_checkpoint(src, out, form="free", online_hadamard=True, verification="none")
    config = json.loads((out / "config.json").read_text())
    row = config["normswap"]["rotation"]["online_hadamard"]["factor"][0]
    config["normswap"]["rotation"]["online_hadamard"]["factor"][0] = ("-" if row[0] == "+" else "+") + row[1:]
    (out / "config.json").write_text(json.dumps(config))
    code, err = run_cli(capsys, "verify", str(src), str(out), "--quiet")
    assert_one_line_error(code, err, "online_hadamard is not the online Hadamard")


@pytest.mark.parametrize(("inner", "options", "needle"), [
    (64, (), "needs --form free"),
    (64, ("--form", "commuting"), "needs --form free"),
    (52, ("--form", "free"), "no Hadamard matrix of order 52"),
    (64, ("--slice", "0.2", "--calibration", "bundled"), "--online-hadamard applies to rotation"),
])  # fmt: skip
def test_refused_where_it_cannot_apply(tmp_path, capsys, inner, options, needle):
    torch.manual_seed(0)
    src = save(T.GPT2LMHeadModel(_gpt2(inner)), tmp_path / "src")
    out = tmp_path / "out"
    code, err = run_cli(capsys, "rotate", str(src), "--out", str(out), "--online-hadamard", *options)
    assert_one_line_error(code, err, needle)
    assert not out.exists()


@pytest.fixture(scope="module")
def online_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("online")
    src = save(make_hard(T.GPT2LMHeadModel(_gpt2(48))).eval(), root / "src")
    rotate_checkpoint(src, root / "online", form="free", online_hadamard=True, verification="none")
    return src, root / "online"


def _tampered(out, tmp_path, edit):
    import shutil

    copy = tmp_path / "tampered"
    shutil.copytree(out, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config["normswap"]["rotation"]["online_hadamard"])
    (copy / "config.json").write_text(json.dumps(config))
    return copy


TAMPERINGS = {
    "huge size": lambda o: o.update(size=10**39),
    "prime order": lambda o: o.update(size=1000004, twos=0),
    "flipped factor": lambda o: o.update(factor=["-" + row[1:] if row[0] == "+" else "+" + row[1:] for row in o["factor"]]),
    "third column flipped": lambda o: o.update(factor=[r[:2] + ("-" if r[2] == "+" else "+") + r[3:] for r in o["factor"]]),
    "junk factor": lambda o: o.update(factor=["x"]),
    "fewer modules": lambda o: o.update(modules=o["modules"][:1]),
    "no such module": lambda o: o.update(modules=["transformer.h.99.mlp.c_proj"]),
    "twos 70": lambda o: o.update(twos=70),
}


@pytest.mark.parametrize("name", list(TAMPERINGS))
def test_a_tampered_record_is_refused_by_every_reader(online_checkpoint, tmp_path, capsys, name):
    """verify (the size bounded before any construction), normswap.load, and the checkpoint's own class."""
    import normswap
    from normswap.errors import NormswapError

    src, out = online_checkpoint
    copy = _tampered(out, tmp_path, TAMPERINGS[name])
    code, err = run_cli(capsys, "verify", str(src), str(copy), "--quiet")
    assert_one_line_error(code, err, "online_hadamard")
    with pytest.raises(NormswapError, match="online_hadamard"):
        normswap.load(copy)
    if name == "no such module":  # eval's loaders, before any model is built
        code, err = run_cli(capsys, "eval", str(copy), "--text", "bundled")
        assert_one_line_error(code, err, "config.json: normswap.rotation.online_hadamard")
    if name not in ("huge size", "prime order", "fewer modules", "third column flipped"):  # what the checkpoint's own file can judge alone
        with pytest.raises(ValueError, match="online_hadamard"):
            T.AutoModelForCausalLM.from_pretrained(copy, trust_remote_code=True)
