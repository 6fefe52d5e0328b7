"""normswap rotate: the rotation math, exactness for every family and method, determinism, refusals.

Exactness follows the conversion tests: each causal family's tiny "hard" model (γ far from 1, β
far from 0, a massive dimension) is rotated with float64 weights and compared with the float64
original to 1e-9 · max|logit|, and rotated with float32 weights (built-in verification on) and
compared to 1e-4. A rotated checkpoint has its own model type, so it loads through its remote
code and ``normswap.load``; stock transformers refuses it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import transformers
from helpers import assert_no_layer_norm, causal_logits, leftovers, load, make_hard, save, token_ids
from test_architectures_causal import CASES, FP64_TOL, QUICK, VOCAB, _family
from test_architectures_encoders import CLIP_TEXT, CLIP_VISION, WHISPER
from test_bad_input import assert_one_line_error, run_cli

import normswap
from normswap.api import rotate_checkpoint
from normswap.convert import fold
from normswap.errors import NormswapError
from normswap.modeling import hadamard
from normswap.rotate import matrices
from normswap.rotate.matrices import ROTATION_FILE, load_rotation

BUNDLED = Path(normswap.__file__).parent / "data"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CALIBRATION = BUNDLED / "text" / "emma-excerpt.txt"


# ---------------------------------------------------------------------------------------------
# The math


def test_rotations_are_one_contraction_in_every_storage_layout():
    generator = torch.Generator().manual_seed(0)
    d, n = 8, 5
    q = matrices.random_orthogonal(d, 1)
    x = torch.randn(3, d, generator=generator, dtype=torch.float64)
    u = torch.randn(3, n, generator=generator, dtype=torch.float64)
    # Conv1D writer W: [in, d], u·W + b written into x
    w_conv, b = torch.randn(n, d, generator=generator, dtype=torch.float64), torch.randn(d, generator=generator,
                                                                                         dtype=torch.float64)
    assert torch.allclose(u @ fold.rotate_axis(w_conv, q, 1) + fold.rotate_axis(b, q, 0), (u @ w_conv + b) @ q)
    # nn.Linear writer stores Wᵀ: [d, in]
    w_linear = w_conv.T.contiguous()
    assert torch.allclose(u @ fold.rotate_axis(w_linear, q, 0).T, (u @ w_conv) @ q)
    # readers: (x·Q)·W' = x·W, Conv1D [d, out] and nn.Linear [out, d]
    r_conv = torch.randn(d, n, generator=generator, dtype=torch.float64)
    assert torch.allclose((x @ q) @ fold.rotate_axis(r_conv, q, 0), x @ r_conv)
    assert torch.allclose((x @ q) @ fold.rotate_axis(r_conv.T.contiguous(), q, 1).T, x @ r_conv)
    head = torch.randn(11, d, generator=generator, dtype=torch.float64)
    assert torch.allclose((x @ q) @ fold.rotate_axis(head, q, 1).T, x @ head.T)
    table = torch.randn(11, d, generator=generator, dtype=torch.float64)
    assert torch.allclose(fold.rotate_axis(table, q, 1), table @ q)
    # a kept bias: RMSNorm(x·Q) + (β⊘γ)·Q = (RMSNorm(x) + β⊘γ)·Q
    kept = torch.randn(d, generator=generator, dtype=torch.float64)

    def rms(v):
        return v / v.pow(2).mean(-1, keepdim=True).sqrt()

    assert torch.allclose(rms(x @ q) + fold.rotate_axis(kept, q, 0), (rms(x) + kept) @ q)
    # a 3-D tensor along its middle axis
    cube = torch.randn(2, d, 3, generator=generator, dtype=torch.float64)
    assert torch.allclose(fold.rotate_axis(cube, q, 1), torch.einsum("akb,kj->ajb", cube, q))


# every hidden size of a common model, and the small orders the constructions start from
HADAMARD_ORDERS = [1, 2, 4, 12, 20, 24, 28, 36, 40, 44, 60, 64, 96, 128, 768, 1024, 1280, 1536, 1600, 2048]


@pytest.mark.parametrize("d", [pytest.param(d, marks=pytest.mark.slow) if d >= 2048 else d for d in HADAMARD_ORDERS])
def test_hadamard_is_orthogonal_for_each_supported_order(d):
    h = hadamard.hadamard_matrix(d).double()
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, d * torch.eye(d, dtype=torch.float64))
    q = matrices.randomised_hadamard(h, seed=5)
    assert torch.allclose(q @ q.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(q.abs(), torch.full((d, d), d**-0.5, dtype=torch.float64))


@pytest.mark.slow
@pytest.mark.parametrize("d", [2560, 4096, 5120])
def test_hadamard_is_orthogonal_for_large_model_orders(d):
    h = hadamard.hadamard_matrix(d).double()
    assert torch.equal(h @ h.T, d * torch.eye(d, dtype=torch.float64))


def test_hadamard_seeds_differ_beyond_coordinate_signs():
    """Two seeds must not give the same stream up to signs (which symmetric quantisers cannot see):
    Q₀ᵀQ₁ must not be a signed permutation."""
    h = hadamard.hadamard_matrix(64)
    relative = matrices.randomised_hadamard(h, 0).T @ matrices.randomised_hadamard(h, 1)
    assert float(relative.abs().max()) < 0.5  # a signed permutation has an entry ±1 in every row


def test_hadamard_constructions_are_named_and_gaps_refused():
    assert hadamard.describe(768) == "sylvester 2^6 ⊗ paley1 p=11"
    assert hadamard.describe(1600) == "sylvester 2^3 ⊗ paley1 p=199"
    assert hadamard.describe(28) == "paley2 p=13"
    for d in (3, 6, 52, 100):  # not multiples of 4, or needing prime-power Paley
        assert hadamard.describe(d) is None
        with pytest.raises(ValueError, match=f"order {d}"):
            hadamard.hadamard_matrix(d)


def test_random_orthogonal_is_orthogonal_and_seeded():
    for d in (5, 32, 100):
        q = matrices.random_orthogonal(d, 7)
        assert torch.allclose(q.T @ q, torch.eye(d, dtype=torch.float64), atol=1e-12)
        assert torch.equal(q, matrices.random_orthogonal(d, 7))
        assert not torch.equal(q, matrices.random_orthogonal(d, 8))


def test_principal_rotation_sorts_directions_and_fixes_signs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(500, 6, generator=generator, dtype=torch.float64) * torch.tensor([1.0, 5, 0.1, 3, 2, 0.5],
                                                                                       dtype=torch.float64)
    q, values = matrices.principal_rotation(x.T @ x)
    assert torch.allclose(q.T @ q, torch.eye(6, dtype=torch.float64), atol=1e-12)
    assert bool((values[:-1] >= values[1:]).all())
    variance = (x @ q).pow(2).sum(0)
    assert torch.allclose(variance, values)
    assert int((x @ q).pow(2).sum(0).argmax()) == 0
    largest = q.abs().argmax(dim=0)
    assert bool((q[largest, torch.arange(6)] > 0).all())
    q_again, _ = matrices.principal_rotation((x.T @ x).clone())
    assert torch.equal(q, q_again)


# ---------------------------------------------------------------------------------------------
# Every family, every method


def make_source(tmp_path: Path, case: str, *, vocab: int = VOCAB, tokenizer: bool = False, **overrides) -> Path:
    torch.manual_seed(0)
    config = CASES[case]()
    config.vocab_size = vocab
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config)
    src = save(make_hard(model).eval(), tmp_path / f"{case}-src")
    if tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copyfile(BUNDLED / "austen-gpt2" / name, src / name)
    return src


def _first_of_each_family() -> list[str]:
    seen, cases = set(), []
    for case in CASES:
        if _family(case) not in seen:
            seen.add(_family(case))
            cases.append(case)
    return cases


def method_params(*, every_method: str, skip_family: str | None = None):
    """(case, method) for every causal case (but ``skip_family``'s) and method. The quick loop
    (-m "not slow") rotates the causal tests' quick cases with Hadamard and the case
    ``every_method`` with the other methods too; the rest is slow."""
    for case in CASES:
        if _family(case) == skip_family:
            continue
        yield pytest.param(case, "hadamard", id=f"{case}-hadamard", marks=() if case in QUICK else pytest.mark.slow)
        for method in ("orthogonal", "pca"):
            yield pytest.param(case, method, id=f"{case}-{method}", marks=() if case == every_method else pytest.mark.slow)


class Run(NamedTuple):
    """One rotation of a causal case: the output, its dtype, its provenance block, and ``error``:
    a loaded model's max |Δ| of logits from the float64 original's, over the run's tolerance."""

    target: Path
    dtype: torch.dtype
    block: dict
    error: Callable[[torch.nn.Module], float]


def rotated_runs(tmp_path: Path, case: str, method: str, *, form: str) -> Iterator[Run]:
    """``case``'s source rotated by ``method`` in ``form`` with float64 weights, unverified, and
    once per family (its first case, with Hadamard; the loaders are shared by the methods) with
    float32 weights and built-in verification, which must pass."""
    pca = method == "pca"
    src = make_source(tmp_path, case, vocab=2048 if pca else VOCAB, tokenizer=pca)
    ids = token_ids(VOCAB)
    reference = causal_logits(load(src, "original", torch.float64), ids)
    scale = max(1.0, float(reference.abs().max()))
    runs = [(torch.float64, FP64_TOL.get(_family(case), 1e-9), "none")]
    if method == "hadamard" and case in _first_of_each_family():
        runs.append((torch.float32, 1e-4, "auto"))
    for dtype, tolerance, verification in runs:
        target = tmp_path / f"rotated-{str(dtype).removeprefix('torch.')}"
        block = rotate_checkpoint(src, target, method=method, seed=3, calibration=CALIBRATION if pca else None,
                                  dtype=dtype, verification=verification, form=form)
        if verification != "none":
            assert block["verification"]["passed"], block["verification"]

        def error(model: torch.nn.Module, bound: float = tolerance * scale) -> float:
            return float((causal_logits(model, ids) - reference).abs().max()) / bound

        yield Run(target, dtype, block, error)


@pytest.mark.parametrize(("case", "method"), list(method_params(every_method="bloom-baked")))
def test_rotation_is_exact(tmp_path, case, method):
    for run in rotated_runs(tmp_path, case, method, form="free"):
        if run.dtype == torch.float32:  # the verified run
            assert run.block["verification"]["loaders"]["stock"] == {"refused": True}
        for how in ("remote", "normswap"):
            model = load(run.target, how, run.dtype)
            assert_no_layer_norm(model)
            assert run.error(model) <= 1, f"{run.dtype} {how}: max |Δ| is {run.error(model):.3g} of the tolerance"
        config = json.loads((run.target / "config.json").read_text())
        assert config["model_type"] == f"normswap_{_family(case)}"
        rotation = config["normswap"]["rotation"]
        assert rotation["method"] == method and rotation["dimension"] == 32
        assert rotation["rotated"]["writers"] > 0 and rotation["rotated"]["readers"] > 0
        q = load_rotation(run.target)
        assert torch.allclose(q @ q.T, torch.eye(32, dtype=torch.float64), atol=1e-12)


def test_hadamard_of_a_paley_order_is_exact(tmp_path):
    """d = 24 = 2·12: a Kronecker product with Paley's order 12, end to end."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=24, n_head=4, vocab_size=VOCAB, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    src = save(make_hard(transformers.GPT2LMHeadModel(config)).eval(), tmp_path / "gpt2-24")
    ids = token_ids(VOCAB)
    reference = causal_logits(load(src, "original", torch.float64), ids)
    out = tmp_path / "rotated"
    block = rotate_checkpoint(src, out, method="hadamard", dtype=torch.float64, verification="full", form="free")
    assert block["verification"]["passed"]
    assert "paley1 p=11" in block["rotation"]["construction"]
    error = float((causal_logits(load(out, "remote", torch.float64), ids) - reference).abs().max())
    assert error <= 1e-9 * max(1.0, float(reference.abs().max()))


@pytest.mark.slow
def test_bundled_model_from_original_and_from_folded_conversion(tmp_path):
    """An original and its --fold-gains conversion rotate to the same weights; both verified,
    the second layer by layer (the stream compared block by block with C·h·Q)."""
    from safetensors.torch import load_file

    direct = tmp_path / "direct"
    block = rotate_checkpoint("normswap:austen-gpt2", direct, method="hadamard", seed=1, form="free")
    assert block["verification"]["passed"] and block["verification"]["mode"] == "full"
    folded = tmp_path / "folded"
    normswap.convert_checkpoint("normswap:austen-gpt2", folded, fold_gains=True, verification="none")
    via_folded = tmp_path / "via-folded"
    block = rotate_checkpoint(folded, via_folded, method="hadamard", seed=1, verification="layerwise", form="free")
    assert block["verification"]["passed"] and block["verification"]["mode"] == "layerwise"
    layers = block["verification"]["loaders"]["remote_code"]["layers"]
    assert len(layers) == 4 and max(layer["max_abs_diff"] / layer["max_abs_reference"] for layer in layers) < 1e-5
    assert not block["verification"]["worst_layer"]["teacher_forced"]  # it passed: free runs only
    assert block["rotated_from"] == str(folded)
    first, second = load_file(direct / "model.safetensors"), load_file(via_folded / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.allclose(first[name], second[name], atol=1e-5), name
    # normswap verify compares a rotated checkpoint with its source
    code = normswap_cli("verify", "normswap:austen-gpt2", str(direct))
    assert code == 0


def normswap_cli(*args: str) -> int:
    from normswap.cli import main

    return main(list(args))


def test_folded_bloom_source_is_verified_whole(tmp_path):
    """A folded BLOOM checkpoint (own model type, baked embedding norm) rotates too."""
    src = make_source(tmp_path, "bloom-baked")
    folded = tmp_path / "folded"
    normswap.convert_checkpoint(src, folded, fold_gains=True, verification="none")
    out = tmp_path / "rotated"
    block = rotate_checkpoint(folded, out, method="orthogonal", verification="layerwise", form="free")
    assert block["verification"]["passed"]
    assert block["verification"]["mode"] == "full"  # the reference needs its remote code
    assert block["structure"]["identity"] == ["transformer.word_embeddings_layernorm"]
    ids = token_ids(VOCAB)
    reference = causal_logits(load(src, "original", torch.float32), ids)
    error = float((causal_logits(load(out, "remote", torch.float32), ids) - reference).abs().max())
    assert error <= 1e-4 * max(1.0, float(reference.abs().max()))


# ---------------------------------------------------------------------------------------------
# Determinism


def _files(path: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(path.iterdir())}


@pytest.mark.slow
def test_same_seed_gives_byte_identical_checkpoints(tmp_path):
    src = make_source(tmp_path, "gpt_neox-parallel-untied")
    first, second, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    rotate_checkpoint(src, first, method="orthogonal", seed=11, verification="full")
    rotate_checkpoint(src, second, method="orthogonal", seed=11, verification="full")
    assert _files(first) == _files(second)
    rotate_checkpoint(src, other, method="orthogonal", seed=12, verification="none")
    hashes = {json.loads((path / "config.json").read_text())["normswap"]["rotation"]["matrix_sha256"]
              for path in (first, other)}
    assert len(hashes) == 2
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_pca_is_deterministic(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    for out in (first, second):
        rotate_checkpoint("normswap:austen-gpt2", out, method="pca", calibration=CALIBRATION, verification="none")
    assert _files(first) == _files(second)
    calibration = json.loads((first / "config.json").read_text())["normswap"]["rotation"]["calibration"]
    assert calibration["text"] == CALIBRATION.name and calibration["tokens"] > 100


def test_rotation_file_is_checked_against_its_hash(tmp_path):
    out = tmp_path / "rotated"
    rotate_checkpoint("normswap:austen-gpt2", out, verification="none")
    from safetensors.torch import save_file

    save_file({"rotation": torch.eye(128, dtype=torch.float64)}, str(out / ROTATION_FILE))
    with pytest.raises(NormswapError, match="does not match the rotation hash"):
        load_rotation(out)


def _tampered(out: Path, tensors: dict | None = None, raw: bytes | None = None, rotation_block=None) -> None:
    """Replace a rotated checkpoint's matrix (recording its hash, as a forger would) or its block."""
    import hashlib

    from safetensors.torch import save_file

    if raw is not None:
        (out / ROTATION_FILE).write_bytes(raw)
    if tensors is not None:
        save_file(tensors, str(out / ROTATION_FILE))
    config = json.loads((out / "config.json").read_text())
    if tensors is not None and "rotation" in tensors:
        config["normswap"]["rotation"]["matrix_sha256"] = hashlib.sha256(
            tensors["rotation"].contiguous().numpy().tobytes()).hexdigest()
    if rotation_block is not None:
        config["normswap"]["rotation"] = rotation_block
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("tamper, needle", [
    ({"tensors": {"rotation": 2 * torch.eye(128, dtype=torch.float64)}}, "not orthogonal"),
    ({"tensors": {"rotation": torch.eye(3, dtype=torch.float64)}}, "128 dimensions"),
    ({"tensors": {"other": torch.eye(128, dtype=torch.float64)}}, "named 'rotation'"),
    ({"raw": b"garbage"}, "not a readable safetensors file"),
    ({"rotation_block": "x"}, "must be a mapping"),
    ({"rotation_block": {"method": "hadamard"}}, "rotation.seed must be an integer"),
])  # fmt: skip
def test_verify_refuses_a_tampered_rotation(tmp_path, capsys, tamper, needle):
    out = tmp_path / "rotated"
    rotate_checkpoint("normswap:austen-gpt2", out, verification="none")
    _tampered(out, **tamper)
    code, err = run_cli(capsys, "verify", "normswap:austen-gpt2", str(out), "--quiet")
    assert_one_line_error(code, err, needle)


def test_verify_refuses_models_of_another_shape(tmp_path, capsys, gpt2_src):
    out = tmp_path / "rotated"
    rotate_checkpoint("normswap:austen-gpt2", out, verification="none")
    code, err = run_cli(capsys, "verify", str(gpt2_src), str(out), "--quiet")
    assert_one_line_error(code, err, "was not converted from", "vocab_size")


# ---------------------------------------------------------------------------------------------
# Refusals and bad input: one line on stderr, non-zero exit, nothing written


@pytest.fixture(scope="module")
def gpt2_src(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return save(make_hard(transformers.GPT2LMHeadModel(config)), tmp_path_factory.mktemp("src") / "gpt2")


def _refused(tmp_path, capsys, *args, needles=()):
    out = tmp_path / "out"
    code, err = run_cli(capsys, "rotate", *args, "--out", str(out))
    assert_one_line_error(code, err, *needles)
    assert not out.exists()
    assert not leftovers(tmp_path)


def test_refuses_unfolded_conversion(tmp_path, capsys, gpt2_src):
    plain = tmp_path / "plain"
    normswap.convert_checkpoint(gpt2_src, plain, verification="none")
    _refused(tmp_path, capsys, str(plain), needles=("without --fold-gains",))


def test_refuses_inexact_conversion(tmp_path, capsys, gpt2_src):
    naive = tmp_path / "naive"
    normswap.convert_checkpoint(gpt2_src, naive, method="naive", allow_inexact=True, fold_gains=True,
                                verification="none")
    _refused(tmp_path, capsys, str(naive), needles=("--method naive", "inexact"))


def test_refuses_already_rotated(tmp_path, capsys, gpt2_src):
    rotated = tmp_path / "rotated"
    rotate_checkpoint(gpt2_src, rotated, verification="none")
    _refused(tmp_path, capsys, str(rotated), needles=("already rotated",))


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        (lambda: transformers.ViTModel(transformers.ViTConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=8,
            patch_size=4)), "its final norm's output is a model output"),
        (lambda: transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**WHISPER)),
         "centres part of its stream at run time"),
        (lambda: transformers.CLIPModel(transformers.CLIPConfig(text_config=CLIP_TEXT, vision_config=CLIP_VISION,
                                                                projection_dim=24)), "cannot rotate"),
    ],
    ids=["vit", "whisper", "clip"],
)
def test_refuses_families_without_rotation_invariant_norms(tmp_path, capsys, model, needle):
    src = save(model(), tmp_path / "src")
    _refused(tmp_path, capsys, str(src), "--form", "free", needles=("cannot rotate", needle))


@pytest.mark.parametrize("form", ["commuting", "free"])
def test_dinov2_is_refused_before_its_weights_are_read(tmp_path, capsys, form):
    """The README's reason, before any weight is read: the tensor data is cut off after the header."""
    model = transformers.Dinov2Model(transformers.Dinov2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=8, patch_size=4))
    src = save(model, tmp_path / "src")
    weights = src / "model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    weights.write_bytes(weights.read_bytes()[:header])
    _refused(tmp_path, capsys, str(src), "--form", form, needles=("its final norm's output is a model output",))


def test_refuses_gain_that_cannot_fold(tmp_path, capsys):
    """GPT-J's q/k/v have no bias slot, so a γ with a zero cannot be folded: the norm keeps its gain."""
    torch.manual_seed(0)
    config = CASES["gptj-tied-headbias"]()
    model = make_hard(transformers.AutoModelForCausalLM.from_config(config))
    with torch.no_grad():
        model.transformer.h[0].ln_1.weight[2] = 0.0
    src = save(model, tmp_path / "gptj")
    _refused(tmp_path, capsys, str(src), needles=("transformer.h.0.ln_1", "γ has zeros"))


def test_refuses_hidden_size_without_hadamard(tmp_path, capsys):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=20 + 32, n_head=4, vocab_size=50, n_positions=16)
    src = save(transformers.GPT2LMHeadModel(config), tmp_path / "gpt2-52")
    _refused(tmp_path, capsys, str(src), needles=("order 52", "--method orthogonal"))


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--method", "pca"), ("needs --calibration",)),
        (("--calibration", "x.txt"), ("only used by a measured rotation (--method pca)",)),
        (("--method", "pca", "--calibration", "/nonexistent.txt"), ("calibration text not found",)),
        (("--seed", "-1"), ("--seed must be an integer from 0",)),
        (("--verify", "full", "--dtype", "float8"), ("unknown dtype",)),
    ],
    ids=["pca-without-text", "text-without-pca", "missing-text", "negative-seed", "bad-dtype"],
)
def test_bad_options(tmp_path, capsys, gpt2_src, args, needles):
    _refused(tmp_path, capsys, str(gpt2_src), *args, needles=needles)


def test_empty_calibration_text(tmp_path, capsys, gpt2_src):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    _refused(tmp_path, capsys, str(gpt2_src), "--method", "pca", "--calibration", str(empty),
             needles=("calibration text is empty",))


def test_pca_needs_a_tokenizer(tmp_path, capsys, gpt2_src):
    _refused(tmp_path, capsys, str(gpt2_src), "--method", "pca", "--calibration", str(CALIBRATION),
             needles=("no tokenizer",))


def test_seed_beyond_64_bits_is_refused(tmp_path, capsys, gpt2_src):
    _refused(tmp_path, capsys, str(gpt2_src), "--seed", str(2**64), needles=("--seed must be an integer",))


def test_out_must_not_overlap_source(tmp_path, capsys, gpt2_src):
    code, err = run_cli(capsys, "rotate", str(gpt2_src), "--out", str(gpt2_src / "inside"))
    assert_one_line_error(code, err, "lies inside the input")


def test_cli_reports_rotation(tmp_path, capsys, gpt2_src):
    out = tmp_path / "rotated"
    code = normswap_cli("rotate", str(gpt2_src), "--out", str(out), "--method", "orthogonal", "--seed", "4",
                        "--form", "free")
    printed = capsys.readouterr().out
    assert code == 0
    assert "rotated by orthogonal (seed 4), d = 16" in printed and "refuses to load, as it must" in printed
    assert (out / ROTATION_FILE).is_file() and (out / "README.md").read_text().count("## Rotation") == 1


# ---------------------------------------------------------------------------------------------
# What a rotation is for: geometry --outliers on a model with a massive residual dimension

STREAM_READERS = ("c_attn", "c_fc", "lm_head")


def test_geometry_shows_rotation_spreading_outliers(tmp_path, capsys):
    """make_hard gives the stream one massive dimension, as trained GPT-2 has: at the layers that
    read the stream, the normalised input has one huge coordinate (large max|x|/RMS, kurtosis far
    above 3). A Hadamard rotation spreads it over every coordinate: both fall, kurtosis toward 3."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    src = save(make_hard(transformers.GPT2LMHeadModel(config)).eval(), tmp_path / "gpt2")
    rotated = tmp_path / "rotated"
    rotate_checkpoint(src, rotated, verification="none")
    report = tmp_path / "geometry" / "report.json"
    code = normswap_cli("geometry", str(src), "--compare", str(rotated), "--outliers", "--random-tokens",
                        "--max-tokens", "256", "--out", str(report.parent))
    printed = capsys.readouterr().out
    assert code == 0 and "is rotated" in printed and "outlier ratio" in printed and "KL W4A8" in printed
    # the layers that read the stream are reported apart, and the rotated model is called so
    assert "| rotated | read the stream | 5 |" in printed and "| original | inside blocks | 4 |" in printed
    assert "| rotated | MLP down projections | 2 |" in printed
    assert "| converted |" not in printed
    reports = json.loads(report.read_text())
    for label in ("original", "converted"):  # the adapter's readers are exactly these layers
        layers = reports[label]["outliers"]["layers"]
        assert [row["reads_stream"] for row in layers] == [
            row["layer"].rsplit(".", 1)[-1] in STREAM_READERS for row in layers]

    def stream(label: str, key: str) -> list[float]:
        layers = reports[label]["outliers"]["layers"]
        return [layer[key] for layer in layers if layer["reads_stream"]]

    before, after = stream("original", "outlier_ratio"), stream("converted", "outlier_ratio")
    assert len(before) == len(after) == 5
    assert max(after) < 0.5 * max(before)
    kurtosis_before, kurtosis_after = stream("original", "kurtosis"), stream("converted", "kurtosis")
    assert max(abs(k - 3) for k in kurtosis_after) < max(abs(k - 3) for k in kurtosis_before)


def test_every_rotation_method_is_one_record_with_a_construction_in_every_form():
    from normswap.checkpoint.rotations import ROTATION_FORMS, ROTATION_METHODS
    from normswap.cli import build_parser
    from normswap.rotate.pipeline import FORM_MODULES, construction

    assert set(FORM_MODULES) == set(ROTATION_FORMS)
    for name in ROTATION_METHODS:
        for form in ROTATION_FORMS:
            assert callable(construction(name, form))
    parser, _ = build_parser("rotate")
    method = next(action for action in parser.subcommand_parsers["rotate"]._actions if action.dest == "method")
    assert list(method.choices) == list(ROTATION_METHODS)
