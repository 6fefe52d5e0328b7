"""Streaming conversion: bounded memory, sharded and .bin inputs, atomicity, determinism, and
layer-by-layer verification."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import causal_logits, leftovers, load, make_hard, save, token_ids
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

import normswap
from normswap.checkpoint import safetensors_io
from normswap.checkpoint.source import CheckpointReader
from normswap.cli import main
from normswap.convert import fold
from normswap.convert.steps import Centre, FoldGain
from normswap.errors import NormswapError, VerificationError
from normswap.runtime import background
from normswap.runtime import offload as verify_offload
from normswap.verify import proof as weights_proof
from normswap.verify.checkpoint import proven_and_compared
from normswap.verify.layerwise import probed_tensors, sampled_blocks

VOCAB = 97
ROOT = Path(__file__).resolve().parents[1]


def tiny_gpt2(path: Path, *, n_layer: int = 3, n_embd: int = 32, shard_size: str | None = None) -> Path:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=VOCAB, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    model = make_hard(GPT2LMHeadModel(config))
    if shard_size is None:
        return save(model, path)
    model.save_pretrained(path, max_shard_size=shard_size)
    return path


def tree_hash(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def max_logit_diff(src: Path, out: Path) -> float:
    ids = token_ids(VOCAB)
    return float((causal_logits(load(src, "original", torch.float32), ids)
                  - causal_logits(load(out, "stock", torch.float32), ids)).abs().max())


# ---------------------------------------------------------------------------------------------
# Formats


def test_sharded_safetensors_in_and_out(tmp_path):
    src = tiny_gpt2(tmp_path / "src", shard_size="40KB")
    source_shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(source_shards) >= 3
    out = tmp_path / "rms"
    block = normswap.convert_checkpoint(src, out, fold_gains=True, verification="none")
    total = len(source_shards)
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in set(index["weight_map"].values()):
        tensors.update(load_file(out / shard))
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert "verification" not in block
    assert max_logit_diff(src, out) < 1e-4


@pytest.mark.slow
def test_sharded_bin_input(tmp_path):
    """pytorch_model-0000k-of-0000N.bin with an index: mapped shard by shard, written as safetensors."""
    src = tiny_gpt2(tmp_path / "src")
    state = GPT2LMHeadModel.from_pretrained(src).state_dict()
    state.pop("lm_head.weight")
    names = sorted(state)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        file = f"pytorch_model-{i:05d}-of-00002.bin"
        torch.save({name: state[name].clone() for name in part}, legacy / file)
        weight_map.update(dict.fromkeys(part, file))
    (legacy / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (legacy / "config.json").write_text((src / "config.json").read_text())
    out = tmp_path / "rms"
    normswap.convert_checkpoint(legacy, out, verification="full")
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    ]
    assert not list(out.glob("*.bin"))
    assert max_logit_diff(src, out) < 1e-4
    layerwise = normswap.verify_checkpoint(legacy, out, layerwise=True)  # weights from the mapped pickles
    assert layerwise["mode"] == "layerwise" and layerwise["passed"]


def test_slice_kernels_match_fold_bit_for_bit():
    """Streaming a tensor slice by slice through fold's in-place kernels gives, bit for bit, what
    the whole-tensor fold functions give."""
    x = torch.randn(300, 64, dtype=torch.float16) + 0.3
    gain = torch.rand(64) + 0.5
    cases = [([Centre(1)], lambda p: fold.centre(p, 1)), ([Centre(0)], lambda p: fold.centre(p, 0)),
             ([FoldGain("g", 1)], lambda p: fold.fold_gain(p, gain, 1)),
             ([Centre(1), FoldGain("g", 1)], lambda p: fold.fold_gain(fold.centre(p, 1), gain, 1))]
    for steps, transform in cases:
        ours = fold.apply_slice_steps(x, steps, {"g": gain}.__getitem__, torch.float16, slice_elements=1000)
        assert torch.equal(ours, transform(x).to(torch.float16))


# ---------------------------------------------------------------------------------------------
# Failures leave nothing


def test_disk_full_leaves_nothing(tmp_path, monkeypatch):
    src = tiny_gpt2(tmp_path / "src", shard_size="40KB")
    calls = []
    real = safetensors_io.write_at

    def full_after_first(fd, offset, data):
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, data)

    monkeypatch.setattr(safetensors_io, "write_at", full_after_first)
    out = tmp_path / "rms"
    with pytest.raises(NormswapError, match="no space left"):
        normswap.convert_checkpoint(src, out, verification="none")
    assert len(calls) > 2
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_corrupt_shards_are_one_line_errors(tmp_path, capsys):
    src = tiny_gpt2(tmp_path / "src", shard_size="40KB")
    shards = sorted(src.glob("*.safetensors"))
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[: len(data) - 100])  # a truncated download
    out = tmp_path / "rms"
    capsys.readouterr()
    assert main(["convert", str(src), "--out", str(out), "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert "corrupt or truncated" in error and shards[-1].name in error and "\n" not in error
    assert not out.exists() and leftovers(tmp_path) == []

    shards[-1].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[24:])
    with pytest.raises(NormswapError, match="unreadable header"):
        normswap.convert_checkpoint(src, out)
    assert not out.exists() and leftovers(tmp_path) == []


def test_shard_shrinking_while_streamed_is_detected(tmp_path):
    src = tiny_gpt2(tmp_path / "src")
    with CheckpointReader(src) as reader:
        os.truncate(src / "model.safetensors", 4096)
        with pytest.raises(NormswapError, match="ends early|corrupt"):
            for name in reader.tensors:
                reader.get(name)


_INTERRUPTED = textwrap.dedent("""
    import sys, time
    import normswap.convert.write as write
    from normswap.cli import main

    real = write.write_tensor
    def slow(*args):
        print("writing", flush=True)
        time.sleep(0.05)
        return real(*args)
    write.write_tensor = slow
    sys.exit(main(["convert", sys.argv[1], "--out", sys.argv[2], "--quiet"]))
""")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_kill_signal_leaves_nothing(tmp_path, signum):
    src = tiny_gpt2(tmp_path / "src", n_layer=6)
    out = tmp_path / "rms"
    child = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, str(src), str(out)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"  # mid-conversion: the temporary output exists
    assert leftovers(tmp_path)
    child.send_signal(signum)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 130, stderr
    assert "interrupted" in stderr
    assert not out.exists()
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Determinism and memory


@pytest.mark.slow
def test_same_input_gives_byte_identical_output(tmp_path):
    src = tiny_gpt2(tmp_path / "src", shard_size="40KB")
    hashes = []
    for name in ("a", "b"):
        normswap.convert_checkpoint(src, tmp_path / name, fold_gains=True, verification="full")
        hashes.append(tree_hash(tmp_path / name))
    assert hashes[0] == hashes[1]
    assert any(name.endswith(".safetensors") for name in hashes[0])


def test_workers_share_the_writing_and_the_proof_with_the_outcome_of_one(tmp_path, monkeypatch):
    """Threads sharing the tensors write the bytes one thread writes, prove with its figures, and
    report the failure it would: the first in plan order, whichever thread met it."""
    from normswap.convert import write
    from normswap.convert.planning import plan_conversion
    from normswap.verify.proof import WrittenProof, prove_weights

    src = tiny_gpt2(tmp_path / "src", shard_size="40KB")
    config = json.loads((src / "config.json").read_text())
    with CheckpointReader(src) as reader:
        plan = plan_conversion(src, config, reader, method="exact", fold_gains=True, dtype=None, build_class=False)[1]
        trees, figures = [], []
        for workers in (1, 2, 3):
            out = tmp_path / f"out{workers}"
            out.mkdir()
            write.write_weights(out, plan, reader, workers=workers)
            trees.append(tree_hash(out))
            figures.append(prove_weights(src, tmp_path / "out1", plan, workers=workers))
        assert len(trees[0]) > 2 and trees[1] == trees[0] and trees[2] == trees[0]
        assert figures[1] == figures[0] and figures[2] == figures[0]
        for workers in (1, 2):  # proven while written: the same bytes, the same figures
            out = tmp_path / f"witnessed{workers}"
            out.mkdir()
            witness = WrittenProof(plan)
            write.write_weights(out, plan, reader, workers=workers, witness=witness)
            assert tree_hash(out) == trees[0]
            assert witness.figures(out) == figures[0]

        names = list(write.tensors_by_shard(plan).values())
        early, late = names[0][1].name, names[-1][-1].name
        written = write.write_tensor

        def failing(fd, position, tensor, source, whole=None, witness=None):
            if tensor.name in (early, late):
                raise NormswapError(f"cannot write {tensor.name}")
            written(fd, position, tensor, source, whole, witness)

        monkeypatch.setattr(write, "write_tensor", failing)
        for workers in (1, 2):
            out = tmp_path / f"failed{workers}"
            out.mkdir()
            with pytest.raises(NormswapError, match=f"cannot write {early}$"):
                write.write_weights(out, plan, reader, workers=workers)

        # an interrupt while the other worker still writes: this thread waits for it to finish its
        # tensor before the files it writes into are closed, and it takes no other
        busy, taken, still_open = threading.Event(), [], []

        def slow(fd, position, tensor, source, whole=None, witness=None):
            if threading.current_thread() is not threading.main_thread():
                taken.append(tensor.name)
                busy.set()
                time.sleep(0.6)
                still_open.append(os.path.exists(f"/proc/self/fd/{fd}"))
            written(fd, position, tensor, source, whole, witness)

        class Interrupted(BaseException):
            pass

        def interrupted(signum, frame):
            raise Interrupted

        monkeypatch.setattr(write, "write_tensor", slow)
        out = tmp_path / "interrupted"
        out.mkdir()
        threading.Thread(target=lambda: (busy.wait(), time.sleep(0.2), os.kill(os.getpid(), signal.SIGUSR1)),
                         daemon=True).start()
        previous = signal.signal(signal.SIGUSR1, interrupted)
        try:
            with pytest.raises(Interrupted):
                write.write_weights(out, plan, reader, workers=2)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert len(taken) == 1 and still_open == [True]

    damaged = tmp_path / "out2" / names[-1][-1].shard
    data = bytearray(damaged.read_bytes())
    data[-2] ^= 0x40
    damaged.write_bytes(bytes(data))
    messages = []
    for workers in (1, 2):
        with pytest.raises(VerificationError) as failure:
            prove_weights(src, tmp_path / "out2", plan, workers=workers)
        messages.append(str(failure.value))
    assert messages[0] == messages[1] and late in messages[0]


@pytest.mark.parametrize("kind", ["computed", "kept"])
def test_convert_fails_on_a_block_stored_wrong_while_it_writes(tmp_path, monkeypatch, kind):
    """The proof taken while writing reads each block back from the file just written: a stored
    block that differs from what the writer computed (or, for a kept tensor, from the source bytes
    it read) fails the conversion with the proof's line, and nothing is left at ``--out``."""
    from normswap.verify.proof import WrittenProof

    src = tiny_gpt2(tmp_path / "src")
    real, hits = WrittenProof._stored, []
    wanted = {"computed": "stored", "kept": "stored chunk"}[kind]

    def damaged(self, fd, position, nbytes, role):
        data = real(self, fd, position, nbytes, role)
        if role == wanted and not hits:  # the first block of that kind, as read back
            hits.append(position)
            data[0] ^= 0x40
        return data

    monkeypatch.setattr(WrittenProof, "_stored", damaged)
    message = {"computed": r"weights proof: \S+ is \S+, but the conversion makes it",
               "kept": r"weights proof: \S+ should be \S+ unchanged, but its bytes differ"}[kind]
    with pytest.raises(VerificationError, match=message):
        normswap.convert_checkpoint(src, tmp_path / "out")
    assert hits and not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def _peak_rss_growth(function) -> int:
    """Bytes by which the process's peak RSS rose above its RSS at the start while ``function`` ran."""
    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current RSS
    before = status("VmRSS")
    function()
    return status("VmHWM") - before


# The peak memory a conversion may add whatever the model's size: the writer's block buffers and,
# growing with depth, a few hundred kB of module objects per layer of the verifying models
STREAMING_CONSTANT = 32e6


def _verified_bound(width: int, vocab: int) -> float:
    """The peak a conversion verified layer by layer may add over its start, whatever the depth:
    ``STREAMING_CONSTANT`` plus what the forward passes must hold at once: a unit's float32
    weights per model (three models: the original, the stock and the RMSNorm forms), a unit being
    a linear layer (GPT-2's largest, [d, 4d], twice: the memory kept for reuse) or a block of its
    rows of at most ``LAYER_SLICE_BYTES``; the probe's logits (three models × 16 positions × the
    vocabulary, float32) and one 16 MB slice of the head's rows, as read and in float32."""
    unit = 2 * min(4 * width * width * 4, verify_offload.LAYER_SLICE_BYTES)
    logits, head_slice = 16 * vocab * 4, 2 * (16 << 20)
    return STREAMING_CONSTANT + 3 * unit + 3 * logits + head_slice


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_peak_memory_does_not_grow_with_depth(tmp_path, monkeypatch):
    """A 24-layer checkpoint converts, proven as it is written and verified layer by layer, within
    the bound of a 2-layer one of its width (``_verified_bound``): the 22 extra blocks (~280 MB of
    weights) do not show up in the peak RSS. Both are written by two threads (each holds its own
    block buffers), as the bigger one would be anyway."""
    from normswap import threads

    monkeypatch.setattr(threads, "PARALLEL_BYTES", 0)
    width = 512
    shallow = tiny_gpt2(tmp_path / "shallow", n_layer=2, n_embd=width)
    deep = tiny_gpt2(tmp_path / "deep", n_layer=24, n_embd=width)
    size = {src: sum(p.stat().st_size for p in src.glob("*.safetensors")) for src in (shallow, deep)}
    # warm up: imports, transformers' caches, and the allocator's first-time growth
    normswap.convert_checkpoint(shallow, tmp_path / "warm-up", verification="layerwise")
    normswap.convert_checkpoint(deep, tmp_path / "warm-up-deep", verification="none")

    def convert(src: Path):
        return lambda: normswap.convert_checkpoint(src, tmp_path / f"{src.name}-rms", verification="layerwise")

    growth = {src: _peak_rss_growth(convert(src)) for src in (shallow, deep)}
    assert size[deep] - size[shallow] > 250e6
    bound = _verified_bound(width, VOCAB)
    assert bound < 0.4 * (size[deep] - size[shallow])  # the extra weights, held, would show
    assert max(growth.values()) < bound, (growth, size, bound)
    assert growth[deep] - growth[shallow] < bound, (growth, size)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_peak_memory_does_not_grow_with_width_or_vocabulary(tmp_path, monkeypatch):
    """Conversion streams every tensor by blocks of rows: its peak stays within
    ``STREAMING_CONSTANT`` whatever the width or the vocabulary (a 67 MB float32 table, 17 MB MLP
    weights). Verification adds what its forward passes must hold (``_verified_bound``), and
    nothing that grows with a whole table or a whole layer: with 2 MB blocks of rows, the bound at
    width 1024 is below what whole layers would take."""
    monkeypatch.setattr(verify_offload, "LAYER_SLICE_BYTES", 2 << 20)
    def gpt2(name: str, width: int, vocab: int) -> Path:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=width, n_head=4, vocab_size=vocab, n_positions=32,
                            bos_token_id=0, eos_token_id=0)
        return save(GPT2LMHeadModel(config), tmp_path / name)

    shapes = {"base": (128, 4096), "vocabulary": (128, 131072), "width": (1024, 4096)}
    sources = {name: gpt2(name, *shape) for name, shape in shapes.items()}
    normswap.convert_checkpoint(sources["base"], tmp_path / "warm-up", verification="layerwise")

    def convert(name: str, verification: str):
        return lambda: normswap.convert_checkpoint(sources[name], tmp_path / f"{name}-{verification}",
                                                   verification=verification)

    for name, (width, vocab) in shapes.items():
        streamed = _peak_rss_growth(convert(name, "none"))
        assert streamed < STREAMING_CONSTANT, (name, streamed)
        verified = _peak_rss_growth(convert(name, "layerwise"))
        assert verified < _verified_bound(width, vocab), (name, verified)
    whole_layers = 3 * 4 * 1024 * 1024 * 4  # one [d, 4d] float32 layer per model
    assert _verified_bound(1024, 4096) < STREAMING_CONSTANT + 2 * (16 << 20) + whole_layers


# ---------------------------------------------------------------------------------------------
# Layer-by-layer verification


@pytest.mark.slow
def test_layerwise_agrees_with_whole_model(tmp_path, monkeypatch, capsys):
    src = tiny_gpt2(tmp_path / "src", shard_size="40KB")
    out = tmp_path / "rms"
    full = normswap.convert_checkpoint(src, out, fold_gains=True, verification="full")["verification"]
    layerwise = normswap.verify_checkpoint(src, out, layerwise=True)
    assert full["mode"] == "full" and layerwise["mode"] == "layerwise"
    assert layerwise["passed"] and full["passed"]
    for loader in ("stock", "remote_code"):
        a, b = full["loaders"][loader], layerwise["loaders"][loader]
        assert abs(a["max_abs_diff"] - b["max_abs_diff"]) < 1e-5
        assert a["top1_agreement"] == b["top1_agreement"]
        assert abs(a["perplexity_reference"] - b["perplexity_reference"]) < 1e-6 * a["perplexity_reference"]
        assert [layer["layer"] for layer in b["layers"]] == [0, 1, 2]
        assert all(layer["max_abs_diff"] < 1e-4 for layer in b["layers"])
    assert 0 <= layerwise["worst_layer"]["layer"] <= 2

    # automatic choice by size, and the CLI flags
    monkeypatch.setattr(verify_offload, "LAYERWISE_ABOVE_BYTES", 0)
    assert main(["verify", str(src), str(out), "--out", str(tmp_path / "v1")]) == 0
    assert json.loads((tmp_path / "v1" / "report.json").read_text())["mode"] == "layerwise"
    assert "worst block" in capsys.readouterr().out
    assert main(["verify", str(src), str(out), "--full", "--out", str(tmp_path / "v2")]) == 0
    assert json.loads((tmp_path / "v2" / "report.json").read_text())["mode"] == "full"
    assert main(["convert", str(src), "--out", str(tmp_path / "cli"), "--verify", "layerwise", "--quiet"]) == 0
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["normswap"]["verification"]["mode"] == "layerwise"


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_layers_loaded_by_row_blocks_give_the_figures_of_whole_layers(tmp_path, monkeypatch, family):
    """Linear layers whose weight is bigger than ``LAYER_SLICE_BYTES`` run from blocks of rows (GPT-2's
    Conv1D summed over its input rows, OPT's nn.Linear by output rows, biases and an uneven last
    block included): the figures are those of whole layers to float32 rounding."""
    from transformers import OPTConfig, OPTForCausalLM

    if family == "gpt2":
        src = tiny_gpt2(tmp_path / "src", n_layer=2)
    else:
        torch.manual_seed(0)
        src = save(make_hard(OPTForCausalLM(OPTConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=37, word_embed_proj_dim=32,
            vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=1))),
            tmp_path / "src")
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, verification="none")
    whole = normswap.verify_checkpoint(src, out, layerwise=True)
    calls = []
    forward = verify_offload.RowBlocks.forward
    monkeypatch.setattr(verify_offload.RowBlocks, "forward", lambda self, x: calls.append(len(self.parts)) or forward(self, x))
    monkeypatch.setattr(verify_offload, "LAYER_SLICE_BYTES", 2000)  # 3 of GPT-2's rows of 128, 15 of OPT's of 32
    blocked = normswap.verify_checkpoint(src, out, layerwise=True)
    assert calls and min(calls) >= 3 and whole["passed"] and blocked["passed"]
    for loader in ("stock", "remote_code"):
        a, b = whole["loaders"][loader], blocked["loaders"][loader]
        assert b["max_abs_diff"] == pytest.approx(a["max_abs_diff"], abs=2e-6)
        assert b["perplexity_reference"] == pytest.approx(a["perplexity_reference"], rel=1e-6)
        assert b["top1_agreement"] == a["top1_agreement"]
        for x, y in zip(a["layers"], b["layers"], strict=True):
            assert y["max_abs_diff"] == pytest.approx(x["max_abs_diff"], abs=2e-6)


def test_layerwise_pinpoints_a_corrupted_block(tmp_path):
    src = tiny_gpt2(tmp_path / "src", n_layer=4)
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, verification="none")
    state = load_file(out / "model.safetensors")
    state["transformer.h.2.mlp.c_fc.weight"] *= 1.05
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VerificationError, match=r"weights proof: transformer\.h\.2\.mlp\.c_fc\.weight should be"):
        normswap.verify_checkpoint(src, out)  # the weights alone show it, before any model runs
    result = normswap.verify_checkpoint(src, out, layerwise=True, proof=False)
    assert not result["passed"]
    assert result["worst_layer"]["layer"] == 2
    layers = result["loaders"]["remote_code"]["layers"]
    others = max(layer["block_max_abs_diff"] for layer in layers if layer["layer"] != 2)
    assert others < 1e-4 and layers[2]["block_max_abs_diff"] > 100 * others
    assert layers[1]["max_abs_diff"] < 1e-4 < layers[3]["max_abs_diff"]  # free run: damage starts at block 2


@pytest.fixture
def proof_process(monkeypatch):
    """Every proof beside a comparison runs in a forked process; yields the processes started."""
    started = []
    original = background.in_process

    def spy(proof, cores):
        proving = original(proof, 2)  # as on a machine with two idle cores
        started.append(proving)
        return proving

    monkeypatch.setattr(background, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(background, "in_process", spy)
    monkeypatch.setattr(verify_offload, "LAYERWISE_ABOVE_BYTES", 0)  # auto picks block by block
    return started


@pytest.mark.skipif(sys.platform != "linux", reason="the proof's own process is forked on Linux only")
def test_a_proof_in_its_own_process_answers_as_the_thread_does(tmp_path, monkeypatch, proof_process):
    src = tiny_gpt2(tmp_path / "src", n_layer=4)
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, verification="none")
    result = normswap.verify_checkpoint(src, out)
    assert [type(proving).__name__ for proving in proof_process] == ["InProcess"]
    assert result["passed"] and result["blocks"] == {"run": [0, 1], "of": 4}
    assert result["proof"] == normswap.prove_checkpoint(src, out)  # the figures of the proof in this process

    # a wrong weight in a block the forward passes skip: the process's failure, as the thread raises it
    state = load_file(out / "model.safetensors")
    state["transformer.h.3.mlp.c_proj.weight"][5] *= 1.5
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VerificationError) as in_process:
        normswap.verify_checkpoint(src, out)
    with pytest.raises(VerificationError) as alone:
        normswap.prove_checkpoint(src, out)
    assert str(in_process.value) == str(alone.value) and "transformer.h.3.mlp.c_proj.weight[5, " in str(alone.value)
    assert main(["verify", str(src), str(out)]) == 3
    assert all(proving.done() for proving in proof_process)


@pytest.mark.skipif(sys.platform != "linux", reason="the proof's own process is forked on Linux only")
def test_the_proof_process_dies_is_cancelled_or_fails_in_one_error(tmp_path, monkeypatch, proof_process):
    src = tiny_gpt2(tmp_path / "src", n_layer=2)
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, verification="none")
    with CheckpointReader(out) as reader:
        plan = weights_proof.rebuilt_conversion_plan(src, json.loads((src / "config.json").read_text()), {},
                                                     reader.tensors)

    def started(work) -> background.InProcess:
        monkeypatch.setattr(weights_proof.WeightsProof, "work", work)  # the forked copy inherits it
        return background.InProcess(weights_proof.WeightsProof(src, out, plan))

    killed = started(lambda self: os._exit(9))  # no answer: one line saying how the process ended
    with pytest.raises(NormswapError, match=r"process of the weights proof exited with status 9 before it answered"):
        killed.result()
    with pytest.raises(ChildProcessError):
        os.waitpid(killed.pid, os.WNOHANG)  # reaped

    def broken(self):
        raise ZeroDivisionError("a bug")

    with pytest.raises(RuntimeError, match="the weights proof failed in its process: ZeroDivisionError: a bug") as bug:
        started(broken).result()
    assert "ZeroDivisionError" in "".join(bug.value.__notes__)  # the copy's traceback

    def unreadable(self):
        raise OSError(errno.EIO, "Input/output error", str(out / "model.safetensors"))

    with pytest.raises(OSError) as io_error:
        started(unreadable).result()
    assert io_error.value.errno == errno.EIO and io_error.value.filename == str(out / "model.safetensors")

    slow = started(lambda self: time.sleep(60))  # an interrupt in this process ends the copy at once
    begun = time.monotonic()
    slow.cancel()
    assert time.monotonic() - begun < 5 and slow.done()
    with pytest.raises(ChildProcessError):
        os.waitpid(slow.pid, os.WNOHANG)

    waiting = started(lambda self: time.sleep(60))  # an interrupt while this process waits for the copy
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            waiting.result()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(ChildProcessError):
        os.waitpid(waiting.pid, os.WNOHANG)

    record = background.error_record(OSError("a short read"))  # no errno: still an OSError
    assert type(background.rebuilt_error(record)) is OSError

    def interrupted(identical, check):
        raise KeyboardInterrupt

    monkeypatch.setattr(weights_proof.WeightsProof, "work", lambda self: time.sleep(60))
    with pytest.raises(KeyboardInterrupt):
        proven_and_compared(src, out, plan, ("layerwise", None), interrupted)
    with pytest.raises(ChildProcessError):
        os.waitpid(proof_process[-1].pid, os.WNOHANG)

    def wrong_contents():
        raise VerificationError("config.json differs")

    begun = time.monotonic()  # a failing check of the folder's contents ends the proof at once
    with pytest.raises(VerificationError, match="config.json differs"):
        proven_and_compared(src, out, plan, ("layerwise", None), interrupted, prepare=wrong_contents)
    assert time.monotonic() - begun < 5
    with pytest.raises(ChildProcessError):
        os.waitpid(proof_process[-1].pid, os.WNOHANG)


def test_mapped_rows_are_the_rows_read(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {"odd": torch.randn(7, 13, generator=generator).to(torch.bfloat16), "empty_rows": torch.empty(4, 0),
               "long": torch.randn(3000, 7, generator=generator)}
    save_file(tensors, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path, mapped=True) as reader:
        for name, tensor in tensors.items():
            rows = tensor.shape[0]
            for start, count in ((0, rows), (1, rows - 1), (rows, 0)):
                mapped = reader.read_rows(name, start, count)
                assert mapped.shape == tensor[start:start + count].shape and torch.equal(mapped,
                                                                                         tensor[start:start + count])
    assert "a weight file shrank while it was read" in background.died(signal.SIGBUS)  # its wait status


@pytest.mark.skipif(sys.platform != "linux", reason="the proof's own process is forked on Linux only")
def test_the_proof_process_starts_before_transformers_is_imported(tmp_path):
    # the import of transformers and the model classes is seconds of Python on one core, which
    # the proof's process spends on the other
    src = tiny_gpt2(tmp_path / "src", n_layer=2)
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, verification="none")
    script = textwrap.dedent(f"""
        import sys
        from normswap.runtime import background, offload
        background.PARALLEL_BYTES = offload.LAYERWISE_ABOVE_BYTES = 0
        started = background.in_process
        imported = []
        background.in_process = lambda work, cores: (imported.append("transformers" in sys.modules),
                                                      started(work, 2))[1]
        from normswap.verify.checkpoint import verify_checkpoint
        passed = verify_checkpoint({str(src)!r}, {str(out)!r})["passed"]
        print(passed, imported, "transformers" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["True", "[False]", "True"], result.stderr[-2000:]


@pytest.mark.skipif(sys.platform != "linux", reason="the proof's own process is forked on Linux only")
def test_the_proof_process_is_checked_by_many_threads_at_once():
    """A lockstep comparison's threads each check the proof's process: its pipe is read, closed
    and reaped once, whichever threads ask together, and every one of them gets its answer."""
    from types import SimpleNamespace

    for _ in range(20):
        proving = background.InProcess(SimpleNamespace(work_alone=lambda: None, figures=lambda: {"tensors": 1}))
        while not proving.done():
            time.sleep(0.001)
        errors, go = [], threading.Barrier(4)

        def check(proving=proving, errors=errors, go=go):
            go.wait()
            try:
                proving.check()
            except BaseException as error:  # noqa: BLE001 (collected for the assertion)
                errors.append(error)

        checking = [threading.Thread(target=check) for _ in range(4)]
        for thread in checking:
            thread.start()
        for thread in checking:
            thread.join()
        assert errors == [] and proving.result() == {"tensors": 1}


@pytest.mark.skipif(sys.platform != "linux", reason="the proof's own process is forked on Linux only")
def test_the_proof_process_ends_with_the_process_that_forked_it():
    # a command killed outright (SIGKILL, the out-of-memory killer) runs no clean-up: its proof's
    # process must not live on with its descriptors (an output's lock, the caller's pipes)
    script = textwrap.dedent("""
        import os, sys, time
        from types import SimpleNamespace
        from normswap.runtime.background import InProcess
        proof = SimpleNamespace(work_alone=lambda: time.sleep(60))
        print(InProcess(proof).pid, flush=True)
        os._exit(0)
    """)
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_sampled_blocks_are_the_first_of_every_kind():
    assert sampled_blocks({}, 48) == [0, 1]
    assert sampled_blocks({}, 2) == [0, 1] and sampled_blocks({}, 1) == [0]
    kinds = ["full", "full", "full", "sliding", "full", "sliding"]
    assert sampled_blocks({"layer_types": kinds, "n_layer": 6}, 6) == [0, 1, 2, 3]
    assert sampled_blocks({"attention_layers": ["global", "local"] * 4, "other": [1, 2]}, 8) == [0, 1]
    names = ["lm_head.weight", "model.layers.0.mlp.weight", "model.layers.10.mlp.weight", "model.layers.2.norm",
             "model.layers.3.mlp.weight", "model.norm.weight", "model.layers.1.layers_x"]
    kinds = ["full"] * 11
    kinds[2] = "sliding"
    assert probed_tensors(names, {"layer_types": kinds}, "model.layers") == [
        "lm_head.weight", "model.layers.0.mlp.weight", "model.layers.2.norm", "model.norm.weight",
        "model.layers.1.layers_x"]
    assert probed_tensors(names, {}, None) == [] and probed_tensors(["a.b"], {}, "h") == []
    odd = ["h.².w", "h." + "9" * 5000 + ".w", "h.0.w"]  # names are the checkpoint's: any text
    assert probed_tensors(odd, {}, "h") == odd


def test_a_proven_checkpoint_runs_sampled_blocks_beside_the_proof(tmp_path, monkeypatch, capsys):
    src = tiny_gpt2(tmp_path / "src", n_layer=5)
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, verification="none")
    monkeypatch.setattr(verify_offload, "LAYERWISE_ABOVE_BYTES", 0)  # auto picks block by block
    orders = []
    made = weights_proof.WeightsProof.__init__

    def noted(self, *args, **kwargs):
        made(self, *args, **kwargs)
        orders.append([self.tensors[index].name for index in self.order])

    monkeypatch.setattr(weights_proof.WeightsProof, "__init__", noted)
    sampled = normswap.verify_checkpoint(src, out)
    assert sampled["passed"] and sampled["mode"] == "layerwise" and sampled["proof"]["recomputed"]
    # the tensors the forward passes read come first, so that the page cache still holds them
    unread = [index for index, name in enumerate(orders[0]) if name.startswith(("transformer.h.2.", "transformer.h.3.",
                                                                              "transformer.h.4."))]
    assert unread == list(range(len(orders[0]) - len(unread), len(orders[0])))
    assert sampled["proof"] == normswap.prove_checkpoint(src, out)  # figures of the plan's order
    assert sampled["blocks"] == {"run": [0, 1], "of": 5}
    assert [layer["layer"] for layer in sampled["loaders"]["stock"]["layers"]] == [0, 1]
    every = normswap.verify_checkpoint(src, out, layerwise=True)  # asked for: every block
    assert "blocks" not in every and len(every["loaders"]["remote_code"]["layers"]) == 5
    assert "blocks" not in normswap.verify_checkpoint(src, out, proof=False)  # unproven weights: every block
    assert main(["verify", str(src), str(out)]) == 0
    assert "compared blocks 0, 1 of 5 layer by layer" in capsys.readouterr().out

    # a wrong weight in a block the forward passes skip fails the proof that runs beside them
    state = load_file(out / "model.safetensors")
    state["transformer.h.2.mlp.c_proj.weight"][3] *= 1.5
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VerificationError, match=r"weights proof: transformer\.h\.2\.mlp\.c_proj\.weight\[3, "):
        normswap.verify_checkpoint(src, out)
    state["transformer.h.0.attn.c_proj.weight"] *= 3.0  # one the forward passes read, and fail on, too
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VerificationError, match=r"weights proof: transformer\.h\.0\.attn\.c_proj\.weight"):
        normswap.verify_checkpoint(src, out)


def test_convert_writes_last_what_its_forward_passes_read(tmp_path, monkeypatch):
    # the newest pages of the page cache when the comparison after the write runs
    from normswap.convert import write

    src = tiny_gpt2(tmp_path / "src", n_layer=5)
    written: list[str] = []
    write_tensor = write.write_tensor
    monkeypatch.setattr(write, "write_tensor", lambda fd, position, tensor, *rest: (
        written.append(tensor.name), write_tensor(fd, position, tensor, *rest))[1])
    normswap.convert_checkpoint(src, tmp_path / "rms")
    unread = [index for index, name in enumerate(written) if name.startswith(("transformer.h.2.", "transformer.h.3.",
                                                                           "transformer.h.4."))]
    assert unread == list(range(len(unread))) and "lm_head.weight" in written[len(unread):]


def test_each_command_parses_each_config_json_once(tmp_path, monkeypatch):
    # transformers' own loader opens config.json for the classes it builds; normswap's steps
    # (side-file checks, planning, provenance, verification, the card) share one parse
    from normswap.checkpoint import bounded

    src, out, rotated = tiny_gpt2(tmp_path / "src", n_layer=2), tmp_path / "rms", tmp_path / "rot"
    parses: list[Path] = []
    read_bytes = bounded._read_bytes
    monkeypatch.setattr(bounded, "_read_bytes", lambda path, what: (parses.append(Path(path)), read_bytes(path, what))[1])
    for command in (["convert", str(src), "--out", str(out), "--quiet"], ["verify", str(src), str(out)],
                    ["inspect", str(src)], ["rotate", str(src), "--out", str(rotated), "--quiet"]):
        bounded._READ_ONCE.clear()
        parses.clear()
        assert main(command) == 0
        configs = [path for path in parses if path.name == "config.json"]
        folders = {path.parent for path in configs}
        assert sorted(map(str, configs)) == sorted(map(str, {folder / "config.json" for folder in folders})), command


def test_row_blocks_of_a_leading_axis_writer_are_the_whole_tensor_math(tmp_path):
    # several blocks per tensor, so the column means come from a pass over blocks
    from normswap.convert import fold
    from normswap.convert.steps import Centre, FoldGain, TensorPlan
    from normswap.convert.write import ShardSource, row_blocks

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 11, generator=generator).to(torch.float16)
    gain = torch.randn(37, generator=generator).to(torch.float16)
    save_file({"w": weight, "g": gain}, tmp_path / "model.safetensors")
    cases = {
        "centre": ([Centre(axis=0)], fold.centre(weight, 0)),
        "gain then centre": ([FoldGain(gain="g", axis=0), Centre(axis=0)], fold.centre(fold.fold_gain(weight, gain, 0), 0)),
    }
    with CheckpointReader(tmp_path) as reader:
        source = ShardSource(reader)
        for label, (steps, expected) in cases.items():
            plan = TensorPlan("w", "w", (37, 11), "float16", "model.safetensors", steps)
            assert source.row_streamable(plan), label
            streamed = torch.cat([block.clone() for _, block in row_blocks(plan, source, slice_elements=5 * 11)])
            assert torch.equal(streamed, expected), label
