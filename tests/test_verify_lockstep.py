"""Layer-by-layer verification with the loads of a conversion in lockstep on shared weight reads.

The stock and RMSNorm forms of a converted checkpoint run block by block in turn, each block's
weights read and converted once for both. The figures must be those of separate runs, bit for
bit, on tiny models of several families; each shared weight is read once instead of once per
load; a failing run stops the other without a hang; a loader that passes runs free only.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
import transformers
from helpers import make_hard, save
from torch import nn

import normswap
from normswap.architectures import architecture_for
from normswap.checkpoint.source import CheckpointReader, read_config
from normswap.convert.planning import plan_conversion
from normswap.memory import BufferPool
from normswap.runtime.lockstep import SharedReads, run_in_lockstep
from normswap.verify.compare import compare_by_sequence, compare_outputs
from normswap.verify.comparison import Comparison
from normswap.verify.layerwise import compare_layerwise
from normswap.verify.proof import prove_weights

SMALL = {"vocab_size": 61, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
FAMILIES = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=32, **SMALL),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                                   intermediate_size=64, max_position_embeddings=32,
                                                   use_parallel_residual=True, tie_word_embeddings=False, **SMALL),
    "opt": lambda: transformers.OPTConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64,
                                          max_position_embeddings=32, word_embed_proj_dim=16, **SMALL),
    "falcon": lambda: transformers.FalconConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, **SMALL),
}


def _converted(tmp_path, family: str, fold_gains: bool = True):
    torch.manual_seed(0)
    model = make_hard(transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()))
    src = save(model, tmp_path / "src")
    out = tmp_path / "rms"
    normswap.convert_checkpoint(src, out, fold_gains=fold_gains, verification="none")
    return src, out, architecture_for(read_config(src))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shared_reads_give_the_figures_of_separate_runs(tmp_path, family):
    src, out, architecture = _converted(tmp_path, family)
    for passes in (None, lambda figures: True):
        _, together = compare_layerwise(Comparison(src, out, architecture), passes=passes)
        _, apart = compare_layerwise(Comparison(src, out, architecture), passes=passes, shared_reads=False)
        assert set(together) == {"stock", "remote_code"}
        assert together == apart  # every figure, bit for bit
        for figures in together.values():
            assert len(figures["layers"]) == 3
            assert figures["max_abs_diff"] <= 1e-4 * figures["max_abs_reference"]
            assert all(layer["max_abs_diff"] <= 1e-5 * layer["max_abs_reference"] for layer in figures["layers"])
            forced = [layer.get("block_max_abs_diff") for layer in figures["layers"]]
            if passes is None:  # teacher-forced too: each block's own error, float32 rounding only
                assert all(error <= 1e-5 * layer["max_abs_reference"]
                           for error, layer in zip(forced, figures["layers"], strict=True))
                assert figures["worst_layer"]["teacher_forced"]
            else:  # passing loads run free only
                assert forced == [None] * 3 and not figures["worst_layer"]["teacher_forced"]


def test_each_shared_weight_is_read_once(tmp_path, monkeypatch):
    src, out, architecture = _converted(tmp_path, "gpt2", fold_gains=False)
    reads: Counter[str] = Counter()
    read_as = CheckpointReader.read_as

    def counted(self, name, dtype, **options):
        if self.path == out and ".h." in name:
            reads[name] += 1
        return read_as(self, name, dtype, **options)

    monkeypatch.setattr(CheckpointReader, "read_as", counted)
    compare_layerwise(Comparison(src, out, architecture), passes=lambda figures: True, shared_reads=False)
    apart, reads = reads.copy(), Counter()
    compare_layerwise(Comparison(src, out, architecture), passes=lambda figures: True)
    together = reads
    assert apart and set(together) == set(apart)
    weights = [name for name in apart if name.endswith("c_attn.weight") or name.endswith("c_fc.weight")]
    assert len(weights) == 6 and all(apart[name] == 2 and together[name] == 1 for name in weights)


def test_a_weight_both_checkpoints_hold_is_read_once_for_all_models(tmp_path, monkeypatch):
    src, out, architecture = _converted(tmp_path, "gpt2", fold_gains=False)
    identical: dict[str, str] = {}
    with CheckpointReader(src) as reader:
        plan = plan_conversion(src, read_config(src), reader, method="exact", fold_gains=False, dtype=None,
                               build_class=False)[1]
    prove_weights(src, out, plan, identical)
    reads: Counter[tuple[str, str]] = Counter()
    read_as = CheckpointReader.read_as

    def counted(self, name, dtype, **options):
        reads["src" if self.path == src else "out", name] += 1
        return read_as(self, name, dtype, **options)

    monkeypatch.setattr(CheckpointReader, "read_as", counted)
    _, alone = compare_layerwise(Comparison(src, out, architecture), passes=lambda figures: True)
    reads.clear()
    _, shared = compare_layerwise(Comparison(src, out, architecture), passes=lambda figures: True,
                                  identical=identical)
    assert shared == alone  # the same float32 values, so every figure bit for bit
    kept = [name for name in identical if name.endswith(("c_attn.weight", "c_fc.weight"))]
    assert len(kept) == 6 and all(reads["src", name] == 1 and reads["out", name] == 0 for name in kept)
    assert reads["out", "transformer.h.0.attn.c_proj.weight"] == 1  # a centred writer is the conversion's own


def test_the_output_head_is_read_once_for_all_models(tmp_path, monkeypatch):
    src, out, architecture = _converted(tmp_path, "gpt2", fold_gains=False)
    with CheckpointReader(src) as reader:
        plan = plan_conversion(src, read_config(src), reader, method="exact", fold_gains=False, dtype=None,
                               build_class=False)[1]
    identical: dict[str, str] = {}
    prove_weights(src, out, plan, identical)
    assert identical["lm_head.weight"] == "transformer.wte.weight"  # the untied head keeps the original matrix
    reads: Counter[str] = Counter()
    read_rows = CheckpointReader.read_rows

    def counted(self, name, start, count, buffer=None):
        if start == 0 and count > 1 and name in ("lm_head.weight", "transformer.wte.weight"):
            reads["src" if self.path == src else "out", name] += 1  # a head's first slice (embeddings read rows)
        return read_rows(self, name, start, count, buffer)

    monkeypatch.setattr(CheckpointReader, "read_rows", counted)
    _, shared = compare_layerwise(Comparison(src, out, architecture), passes=lambda figures: True,
                                  identical=identical)
    assert reads == {("src", "transformer.wte.weight"): 1}  # one pass for the original and both loads
    reads.clear()
    _, alone = compare_layerwise(Comparison(src, out, architecture), passes=lambda figures: True,
                                 shared_reads=False)
    assert shared == alone and sum(reads.values()) == 3


class _Head(nn.Module):
    """A head that shares its pass with the heads of the same key (as ``HeadByVocabularyChunk``)."""

    pass_key = "head"

    def __init__(self, passes: list) -> None:
        super().__init__()
        self.passes, self.shared = passes, None

    def forward(self, hidden):
        return self.pass_over([hidden])[0] if self.shared is None else self.shared.logits(self, hidden)

    def pass_over(self, hiddens):
        self.passes.append(len(hiddens))
        return [hidden * 2 for hidden in hiddens]


class _WithHead(nn.Module):
    def __init__(self, passes: list, fail_at: int | None = None, skip_head: bool = False) -> None:
        super().__init__()
        self.blocks = _Blocks("m", [], fail_at).blocks
        self.head, self.skip_head = _Head(passes), skip_head

    def forward(self):
        for block in self.blocks:
            block()
        return None if self.skip_head else self.head(torch.ones(1))


def test_heads_of_one_weight_share_a_pass_and_a_failure_releases_them():
    passes: list = []
    models = [_WithHead(passes) for _ in range(3)]
    results = run_in_lockstep(models, [[*model.blocks, model.head] for model in models], [m.head for m in models])
    assert passes == [3] and all(torch.equal(result, torch.full((1,), 2.0)) for result in results)
    assert all(model.head.shared is None for model in models)
    passes.clear()
    models = [_WithHead(passes), _WithHead(passes, skip_head=True), _WithHead(passes)]  # one never asks
    assert run_in_lockstep(models, [[*model.blocks] for model in models], [m.head for m in models])[1] is None
    assert passes == [2]
    threads = threading.active_count()
    models = [_WithHead(passes), _WithHead(passes, fail_at=3), _WithHead(passes)]
    with pytest.raises(ValueError, match="m failed at 3"):  # the others wait at their heads: released
        run_in_lockstep(models, [[*model.blocks] for model in models], [m.head for m in models])
    assert threading.active_count() == threads
    passes.clear()
    models = [_WithHead(passes) for _ in range(3)]
    models[0].head.pass_key = "another weight"  # a head outside the pass would run beside it: each takes its turn
    run_in_lockstep(models, [[*model.blocks, model.head] for model in models], [m.head for m in models])
    assert passes == [1, 1, 1]


def test_a_failing_load_is_teacher_forced_alone(tmp_path):
    src, out, architecture = _converted(tmp_path, "gpt2")
    judged = []

    def fails_stock(figures):
        judged.append(figures["max_abs_diff"])
        return len(judged) > 1  # the first load judged (stock) fails

    _, loaders = compare_layerwise(Comparison(src, out, architecture), passes=fails_stock)
    assert all("block_max_abs_diff" in layer for layer in loaders["stock"]["layers"])
    assert loaders["stock"]["worst_layer"]["teacher_forced"]
    assert not any("block_max_abs_diff" in layer for layer in loaders["remote_code"]["layers"])


class _Blocks(nn.Module):
    def __init__(self, name: str, log: list, fail_at: int | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Step(name, index, log, fail_at) for index in range(4))

    def forward(self) -> str:
        for block in self.blocks:
            block()
        return "done"


class _Step(nn.Module):
    def __init__(self, name: str, index: int, log: list, fail_at: int | None) -> None:
        super().__init__()
        self.name, self.index, self.log, self.fail_at = name, index, log, fail_at

    def forward(self) -> None:
        if self.index == self.fail_at:
            raise ValueError(f"{self.name} failed at {self.index}")
        self.log.append((self.name, self.index))


def test_lockstep_takes_turns_block_by_block():
    log: list = []
    a, b = _Blocks("a", log), _Blocks("b", log)
    assert run_in_lockstep([a, b], [a.blocks, b.blocks]) == ["done", "done"]
    assert log == [(name, index) for index in range(4) for name in "ab"]


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failure_in_either_run_stops_both_and_is_raised(failing):
    log: list = []
    threads = threading.active_count()
    models = [_Blocks(name, log, fail_at=2 if index == failing else None) for index, name in enumerate("ab")]
    with pytest.raises(ValueError, match=f"{'ab'[failing]} failed at 2"):
        run_in_lockstep(models, [model.blocks for model in models])
    assert len(log) <= 6 and threading.active_count() == threads


def test_shared_reads_keep_a_tensor_until_its_last_reader():
    shared, reads = SharedReads(), Counter()

    def read(name):
        reads[name] += 1
        return torch.zeros(1)

    shared.expect(["w", "w", "only"])
    first = shared.get("w", lambda: read("w"))
    assert shared.get("w", lambda: read("w")) is first and "w" not in shared.kept
    shared.get("only", lambda: read("only"))
    assert reads == {"w": 1, "only": 1} and not shared.kept


def test_position_chunks_give_the_whole_batch_figures():
    torch.manual_seed(0)
    reference = torch.randn(2, 21, 37, dtype=torch.float64) * 4
    candidate = reference + 1e-3 * torch.randn_like(reference)
    labels = torch.randint(0, 37, (2, 21))
    whole = compare_outputs(reference, candidate, distribution=True, labels=labels)
    for positions in (1, 5, 16, 64):
        chunked = compare_by_sequence(reference, candidate, labels, positions=positions)
        assert chunked.keys() == whole.keys()
        for key, value in whole.items():
            assert chunked[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_the_buffer_pool_hands_out_only_memory_nothing_uses():
    pool = BufferPool(min_bytes=0)
    first = pool.empty((1024,), torch.float32)
    address = first.data_ptr()
    assert pool.empty((1024,), torch.float32).data_ptr() != address  # ``first`` still holds it
    del first
    again = pool.empty((32, 32), torch.float32)  # same size, another shape
    assert again.data_ptr() == address and again.shape == (32, 32) and again.is_contiguous()
    held = nn.Parameter(again)  # a module's parameter keeps it in use
    del again
    assert pool.empty((1024,), torch.float32).data_ptr() != address
    del held
    storage = pool.empty((1024,), torch.float32).untyped_storage()  # the pool's own storage object, held
    assert pool.empty((1024,), torch.float32).data_ptr() != storage.data_ptr()
    del storage
    assert pool.empty((4096,), torch.uint8).data_ptr() == address
    assert BufferPool().empty((4,), torch.float32).numel() == 4  # below the size pooled: plain memory
