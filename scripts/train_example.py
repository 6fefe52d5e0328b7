#!/usr/bin/env python
"""Train normswap's bundled offline example model: a tiny GPT-2 on Jane Austen.

The script is deterministic for a fixed ``--seed`` (CPU, fixed thread count, deterministic torch
algorithms). It

1. reads the six Austen novels from ``--data`` (default ``../shared/data/austen``, relative to the
   repository root) and holds out ``persuasion.txt`` for evaluation;
2. trains a byte-level BPE tokenizer (GPT-2 style: ByteLevel pre-tokenizer and decoder,
   ``<|endoftext|>`` special token) on the five training novels;
3. trains a small GPT-2 (pre-LN, LayerNorm with bias, tied embeddings) on the training novels,
   concatenated with ``<|endoftext|>`` between documents, sampling random 256-token windows;
4. reports held-out token perplexity on Persuasion against a unigram baseline;
5. saves model (safetensors, fp32), tokenizer and generation config into
   ``normswap/data/austen-gpt2/`` together with ``TRAINING.md`` and ``training_metrics.json``,
   and copies text excerpts to ``normswap/data/text/``;
6. reloads the saved directory with the Auto classes (offline) and checks the perplexity matches.

Perplexity protocol (both model and unigram): the text is tokenized whole, ``<|endoftext|>`` is
prepended as context, and the sequence is cut into windows of ``n_positions`` tokens that overlap
by one token, so that every text token is predicted exactly once, with at most ``n_positions - 1``
tokens of context. PPL = exp(sum of token NLL / number of text tokens).

The unigram baseline estimates p(t) = (count(t) + 1) / (N + V) on the training tokens (add-one
smoothing over the V-token vocabulary) and is evaluated on the same held-out tokens.

Usage (from the repository root)::

    python scripts/train_example.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NOVELS = (
    "emma.txt",
    "mansfieldpark.txt",
    "northangerabbey.txt",
    "persuasion.txt",
    "prideprejudice.txt",
    "sensesensibility.txt",
)
HELD_OUT = "persuasion.txt"
EOS = "<|endoftext|>"

# the model's and the run's settings by flag; each flag takes its default's type
HYPERPARAMETERS = {
    "--seed": 1234, "--threads": 2, "--vocab-size": 2048,
    "--n-layer": 4, "--n-embd": 128, "--n-head": 4, "--n-positions": 256,
    "--steps": 800, "--batch-size": 16, "--lr": 3e-3, "--min-lr-ratio": 0.1, "--warmup": 50, "--weight-decay": 0.1,
    "--eval-every": 100, "--heldout-excerpt-bytes": 60_000, "--train-excerpt-bytes": 5_000,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data/austen", help="Austen directory (relative to repo root)")
    p.add_argument("--out", default="normswap/data/austen-gpt2", help="model output directory")
    p.add_argument("--text-out", default="normswap/data/text", help="directory for text excerpts")
    for flag, default in HYPERPARAMETERS.items():
        p.add_argument(flag, type=type(default), default=default)
    p.add_argument("--benchmark", type=int, default=0, help="only time N training steps and exit")
    p.add_argument(
        "--render-only", action="store_true", help="only rewrite TRAINING.md from training_metrics.json"
    )
    return p.parse_args(argv)


def repo_path(p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else (REPO_ROOT / path)


def read_text(path: Path) -> str:
    # Normalise line endings so the result does not depend on how the files were checked out.
    return path.read_text(encoding="utf-8").replace("\r\n", "\n")


def cut_at_paragraph(text: str, max_chars: int) -> str:
    """Return the longest prefix of ``text`` of at most ``max_chars`` characters ending at a paragraph."""
    if len(text) <= max_chars:
        return text.rstrip() + "\n"
    cut = text.rfind("\n\n", 0, max_chars)
    if cut <= 0:
        raise SystemExit(f"no paragraph boundary within the first {max_chars} characters")
    return text[:cut].rstrip() + "\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE exactly as GPT-2 (ByteLevel pre-tokenizer with the GPT-2 regex, no prefix space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(raw, n_positions: int):
    """Wrap the trained tokenizer as transformers' GPT-2 tokenizer (tokenizers backend)."""
    from transformers import GPT2Tokenizer

    model = json.loads(raw.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    hf = GPT2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        unk_token=EOS,
        bos_token=EOS,
        eos_token=EOS,
        add_prefix_space=False,
        model_max_length=n_positions,
    )
    return hf


# ----------------------------------------------------------------------------------------------------------
# evaluation


def eval_windows(ids: list[int], bos_id: int, block: int) -> list[list[int]]:
    """Windows of ``block`` tokens over [bos] + ids overlapping by one: each text token predicted once."""
    seq = [bos_id] + list(ids)
    step = block - 1
    return [seq[i : i + block] for i in range(0, len(seq) - 1, step)]


def model_nll(model, ids: list[int], bos_id: int, block: int, batch_size: int = 16) -> tuple[float, int]:
    """Sum of next-token NLL (nats, float64 accumulation) over all of ``ids`` and the token count."""
    import torch
    import torch.nn.functional as F

    windows = eval_windows(ids, bos_id, block)
    total = 0.0
    count = 0
    model.eval()
    with torch.no_grad():
        # Full windows batched; the (shorter) last window on its own.
        full = [w for w in windows if len(w) == block]
        rest = [w for w in windows if len(w) != block]
        batches = [full[i : i + batch_size] for i in range(0, len(full), batch_size)] + [[w] for w in rest]
        for b in batches:
            x = torch.tensor(b, dtype=torch.long)
            logits = model(input_ids=x).logits.float()
            nll = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(nll.double())
            count += x[:, 1:].numel()
    assert count == len(ids), (count, len(ids))
    return total, count


def unigram_nll(counts, ids: list[int]) -> tuple[float, int]:
    """Add-one-smoothed unigram NLL of ``ids``; ``counts`` is a float64 tensor of training counts."""
    import torch

    logp = torch.log((counts + 1.0) / (counts.sum() + counts.numel()))
    idx = torch.tensor(ids, dtype=torch.long)
    return float(-logp[idx].sum()), len(ids)


def ppl(nll_count: tuple[float, int]) -> float:
    return math.exp(nll_count[0] / nll_count[1])


# ----------------------------------------------------------------------------------------------------------
# main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        out_dir = repo_path(args.out)
        metrics = json.loads((out_dir / "training_metrics.json").read_text(encoding="utf-8"))
        (out_dir / "TRAINING.md").write_text(render_training_md(metrics), encoding="utf-8")
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"

    import random

    import numpy as np
    import torch
    import transformers
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    data_dir = repo_path(args.data)
    out_dir = repo_path(args.out)
    text_dir = repo_path(args.text_out)
    missing = [n for n in NOVELS if not (data_dir / n).is_file()]
    if missing:
        raise SystemExit(f"missing novels in {data_dir}: {', '.join(missing)}")
    texts = {n: read_text(data_dir / n) for n in NOVELS}
    train_names = [n for n in NOVELS if n != HELD_OUT]
    train_texts = [texts[n] for n in train_names]

    # ---- tokenizer
    t0 = time.perf_counter()
    raw_tok = train_tokenizer(train_texts, args.vocab_size)
    tok = wrap_tokenizer(raw_tok, args.n_positions)
    eos_id = tok.convert_tokens_to_ids(EOS)
    vocab_size = len(tok)
    print(f"tokenizer: vocab {vocab_size}, eos id {eos_id}, trained in {time.perf_counter() - t0:.1f}s")

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    train_ids = {n: encode(texts[n]) for n in train_names}
    heldout_ids = encode(texts[HELD_OUT])
    # The transformers wrapper must tokenize exactly as the trained tokenizer.
    for n in train_names[:1] + [HELD_OUT]:
        assert encode(texts[n]) == raw_tok.encode(texts[n]).ids, f"wrapper/tokenizer mismatch on {n}"
    assert tok.decode(heldout_ids) == texts[HELD_OUT], "tokenizer does not round-trip"

    stream: list[int] = []
    for n in train_names:
        stream.append(eos_id)
        stream.extend(train_ids[n])
    stream_t = torch.tensor(stream, dtype=torch.long)
    n_train_tokens = sum(len(v) for v in train_ids.values())
    print(f"training tokens: {n_train_tokens:,} ({len(stream):,} with separators); held-out: {len(heldout_ids):,}")

    counts = torch.bincount(torch.cat([torch.tensor(v) for v in train_ids.values()]), minlength=vocab_size)
    counts = counts.double()

    # ---- model
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_inner=None,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        initializer_range=0.02,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=True,
        use_cache=True,
    )
    model = GPT2LMHeadModel(config)
    model.to(torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters (tied embeddings)")

    decay = [p for n_, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n_, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)

    gen = torch.Generator().manual_seed(args.seed)
    block = args.n_positions
    offsets = torch.arange(block)
    # Evaluation during training on a fixed slice of the held-out novel (cheap progress signal).
    probe_ids = heldout_ids[: 20 * (block - 1)]

    n_steps = args.benchmark or args.steps
    log = []
    t_train = time.perf_counter()
    cpu_train = time.process_time()
    running = None
    for step in range(n_steps):
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        starts = torch.randint(0, len(stream) - block, (args.batch_size,), generator=gen)
        x = stream_t[starts[:, None] + offsets]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.item()
        running = lv if running is None else 0.98 * running + 0.02 * lv
        if (step + 1) % args.eval_every == 0 or step + 1 == n_steps or (step + 1) == 10:
            elapsed = time.perf_counter() - t_train
            probe = ppl(model_nll(model, probe_ids, eos_id, block))
            rate = (step + 1) * args.batch_size * block / elapsed
            print(
                f"step {step + 1:5d}/{n_steps}  loss {lv:.4f}  (ema {running:.4f})  probe ppl {probe:8.2f}  "
                f"lr {lr_at(step):.2e}  {elapsed:6.1f}s  {rate:,.0f} tok/s",
                flush=True,
            )
            log.append({"step": step + 1, "train_loss_ema": round(running, 4), "probe_ppl": round(probe, 3)})
    train_time = time.perf_counter() - t_train
    train_cpu = time.process_time() - cpu_train
    if args.benchmark:
        print(f"benchmark: {n_steps} steps in {train_time:.1f}s -> {train_time / n_steps:.3f}s/step")
        return 0

    # ---- evaluation
    heldout_model = model_nll(model, heldout_ids, eos_id, block)
    heldout_unigram = unigram_nll(counts, heldout_ids)
    ppl_model, ppl_uni = ppl(heldout_model), ppl(heldout_unigram)
    print(f"held-out ({HELD_OUT}) perplexity: model {ppl_model:.4f}  unigram {ppl_uni:.4f}")
    if not ppl_model < 0.5 * ppl_uni:
        raise SystemExit("model is not clearly better than the unigram baseline")

    # ---- text excerpts
    text_dir.mkdir(parents=True, exist_ok=True)
    heldout_excerpt = cut_at_paragraph(texts[HELD_OUT], args.heldout_excerpt_bytes)
    train_excerpt = cut_at_paragraph(texts["emma.txt"], args.train_excerpt_bytes)
    (text_dir / "persuasion-excerpt.txt").write_text(heldout_excerpt, encoding="utf-8", newline="\n")
    (text_dir / "emma-excerpt.txt").write_text(train_excerpt, encoding="utf-8", newline="\n")
    excerpt_ids = encode(heldout_excerpt)
    excerpt_model = model_nll(model, excerpt_ids, eos_id, block)
    excerpt_unigram = unigram_nll(counts, excerpt_ids)

    # ---- save
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    for f in out_dir.iterdir():
        f.chmod(0o644)

    # ---- verify the saved directory offline with the Auto classes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    re_tok = AutoTokenizer.from_pretrained(out_dir)
    re_model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    assert type(re_tok).__name__ == "GPT2Tokenizer", type(re_tok)
    assert re_tok.eos_token == EOS and re_tok.bos_token == EOS and re_tok.unk_token == EOS
    assert re_tok.eos_token_id == eos_id == re_model.config.eos_token_id == re_model.config.bos_token_id
    assert len(re_tok) == re_model.config.vocab_size == vocab_size
    assert re_model.config.tie_word_embeddings
    assert re_model.lm_head.weight.data_ptr() == re_model.transformer.wte.weight.data_ptr(), "head not tied"
    re_excerpt_ids = re_tok(heldout_excerpt, add_special_tokens=False, verbose=False)["input_ids"]
    assert re_excerpt_ids == excerpt_ids, "reloaded tokenizer tokenizes differently"
    re_excerpt_model = model_nll(re_model, re_excerpt_ids, eos_id, block)
    rel = abs(ppl(re_excerpt_model) - ppl(excerpt_model)) / ppl(excerpt_model)
    print(
        f"excerpt ({len(excerpt_ids)} tokens) perplexity: in-memory {ppl(excerpt_model):.6f}  "
        f"reloaded {ppl(re_excerpt_model):.6f}  (rel diff {rel:.2e})  unigram {ppl(excerpt_unigram):.4f}"
    )
    assert rel < 1e-6, "reloaded perplexity differs"

    # ---- sample
    torch.manual_seed(args.seed)
    prompt = "It was a truth"
    enc = re_tok(prompt, return_tensors="pt")
    greedy = re_model.generate(**enc, max_new_tokens=60, do_sample=False)
    sampled = re_model.generate(**enc, max_new_tokens=60, do_sample=True, top_k=50, temperature=0.8)
    greedy_text = re_tok.decode(greedy[0], skip_special_tokens=True)
    sample_text = re_tok.decode(sampled[0], skip_special_tokens=True)
    print("greedy :", greedy_text.replace("\n", " "))
    print("sampled:", sample_text.replace("\n", " "))

    # ---- metrics and model notes
    weights = out_dir / "model.safetensors"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    hparams = {
        "vocab_size": vocab_size,
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "n_head": args.n_head,
        "n_inner": 4 * args.n_embd,
        "n_positions": args.n_positions,
        "activation_function": "gelu_new",
        "dropout": 0.0,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        "n_parameters": n_params,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "tokens_per_step": args.batch_size * block,
        "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8), grad clip 1.0",
        "lr": args.lr,
        "lr_schedule": f"linear warmup {args.warmup} steps, cosine to {args.min_lr_ratio} x lr",
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "threads": args.threads,
    }
    metrics = {
        "data": {
            "train": train_names,
            "held_out": HELD_OUT,
            "train_tokens": n_train_tokens,
            "held_out_tokens": len(heldout_ids),
            "sha256": {n: sha256(texts[n].encode("utf-8")) for n in NOVELS},
        },
        "tokenizer": {"type": "byte-level BPE (GPT-2 style)", "vocab_size": vocab_size, "eos_token": EOS,
                      "eos_token_id": eos_id},
        "hyperparameters": hparams,
        "held_out_perplexity": {
            "protocol": f"windows of {block} tokens overlapping by 1, <|endoftext|> prepended, every token "
            "predicted once; unigram: add-one smoothed counts on the training tokens",
            "model": round(ppl_model, 4),
            "unigram": round(ppl_uni, 4),
            "model_nll_per_token": round(heldout_model[0] / heldout_model[1], 6),
            "unigram_nll_per_token": round(heldout_unigram[0] / heldout_unigram[1], 6),
            "tokens": heldout_model[1],
        },
        "excerpt_perplexity": {
            "file": "normswap/data/text/persuasion-excerpt.txt",
            "tokens": excerpt_model[1],
            "model": round(ppl(excerpt_model), 4),
            "model_reloaded": round(ppl(re_excerpt_model), 4),
            "unigram": round(ppl(excerpt_unigram), 4),
        },
        "training_log": log,
        "train_time_s": round(train_time, 1),
        "train_cpu_time_s": round(train_cpu, 1),
        "checkpoint_bytes": weights.stat().st_size,
        "samples": {"prompt": prompt, "greedy": greedy_text, "sampled_top_k50_t0.8": sample_text},
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": __import__("tokenizers").__version__,
            "git_commit": commit,
        },
        "command": "python scripts/train_example.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    (out_dir / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    (out_dir / "TRAINING.md").write_text(render_training_md(metrics), encoding="utf-8")
    total = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"saved {out_dir} ({total / 1e6:.2f} MB); train time {train_time:.0f}s")
    return 0


def render_training_md(m: dict) -> str:
    h = m["hyperparameters"]
    ho = m["held_out_perplexity"]
    ex = m["excerpt_perplexity"]
    d = m["data"]
    train_time = f"{m['train_time_s']:.0f} s wall"
    if "train_cpu_time_s" in m:
        train_time += f" ({m['train_cpu_time_s']:.0f} s CPU)"
    train_time += " on CPU; the machine was shared, so wall time varies"
    return f"""# austen-gpt2: normswap's bundled example model

A tiny GPT-2-architecture language model (pre-LN, LayerNorm with bias, tied input/output embeddings)
trained from scratch on five Jane Austen novels, shipped so that `normswap convert normswap:austen-gpt2`
works offline. It is a test article, not a useful language model.

## Data
- Training: {", ".join(d["train"])} ({d["train_tokens"]:,} tokens), documents joined with `<|endoftext|>`.
- Held out: **{d["held_out"]}** ({d["held_out_tokens"]:,} tokens), never seen by tokenizer or model.
- Texts: public domain, from `../shared/data/austen` (SHA-256 of each file in `training_metrics.json`).
- `normswap/data/text/persuasion-excerpt.txt`: first ~60 KB of the held-out novel, cut at a paragraph.
  `normswap/data/text/emma-excerpt.txt`: first ~5 KB of Emma (a *training* novel), for tests.

## Tokenizer
Byte-level BPE in GPT-2 style (`tokenizers`: ByteLevel pre-tokenizer with the GPT-2 regex, no prefix
space, ByteLevel decoder), {m["tokenizer"]["vocab_size"]} tokens, trained on the five training novels;
`<|endoftext|>` (id {m["tokenizer"]["eos_token_id"]}) is bos/eos/unk. Loads with
`AutoTokenizer.from_pretrained` as `GPT2Tokenizer` (tokenizers backend).

## Model and training
| setting | value |
|---|---|
| layers / width / heads | {h["n_layer"]} / {h["n_embd"]} / {h["n_head"]} (MLP {h["n_inner"]}, gelu_new) |
| context | {h["n_positions"]} |
| parameters | {h["n_parameters"]:,} (fp32 safetensors, {m["checkpoint_bytes"] / 1e6:.1f} MB) |
| dropout | {h["dropout"]} |
| steps x batch | {h["steps"]} x {h["batch_size"]} windows of {h["n_positions"]} tokens (random offsets) |
| optimizer | {h["optimizer"]} |
| learning rate | {h["lr"]}, {h["lr_schedule"]} |
| weight decay | {h["weight_decay"]} (matrices only) |
| seed / threads | {h["seed"]} / {h["threads"]} (CPU, deterministic algorithms) |
| training time | {train_time} |

## Held-out perplexity
Protocol: {ho["protocol"]}.

| text | tokens | model | unigram baseline |
|---|---|---|---|
| {d["held_out"]} (whole novel) | {ho["tokens"]:,} | **{ho["model"]:.2f}** | {ho["unigram"]:.2f} |
| persuasion-excerpt.txt | {ex["tokens"]:,} | {ex["model"]:.2f} | {ex["unigram"]:.2f} |

The reloaded checkpoint (`AutoModelForCausalLM` / `AutoTokenizer`, `HF_HUB_OFFLINE=1`) reproduces the
excerpt perplexity ({ex["model_reloaded"]:.4f}).

Sample (prompt `{m["samples"]["prompt"]}`, top-k 50, temperature 0.8):

> {m["samples"]["sampled_top_k50_t0.8"].replace(chr(10), " ")}

## Reproduce
From the repository root (deterministic for a fixed seed on the same hardware and software stack;
about 0.5 s per step on 2 idle CPU threads):

    {m["command"].strip()}

Figures are also in `training_metrics.json`.
"""


if __name__ == "__main__":
    sys.exit(main())
