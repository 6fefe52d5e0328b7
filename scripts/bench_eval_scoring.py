"""Benchmark lm-eval scoring at a real vocabulary: lm-eval's ``HFLM`` against normswap's
``SharedContextHFLM``, request kind by request kind, interleaved in one run.

The bundled model's vocabulary (2,048) makes the output head and the log-softmax nearly free; at
GPT-2's 50,257 they are most of a small model's scoring. A random GPT-2-shaped model (4 blocks,
d = 256, vocabulary 50,257, 512 positions) scores random token requests of three kinds:

* ``cloze``: four choices of 1-4 tokens sharing a 100-300 token context;
* ``lastword``: one 1-2 token continuation after a 100-300 token context;
* ``rolling``: 511-token windows after a one-token context, as lm-eval's rolling loglikelihood sends.

    python scripts/bench_eval_scoring.py [--rounds 3] [--out benchmarks/results/bench_eval_scoring.json]

Prints the best of ``--rounds`` seconds per path and the ratio normswap / HFLM (below 1: faster).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCAB = 50257
POSITIONS = 512


def requests(seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    cloze = []
    for _ in range(32):
        context = tokens(rng.randrange(100, 300))
        cloze += [(None, context, tokens(rng.randrange(1, 5))) for _ in range(4)]
    return {
        "cloze": cloze,
        "lastword": [(None, tokens(rng.randrange(100, 300)), tokens(rng.randrange(1, 3))) for _ in range(64)],
        "rolling": [(None, tokens(1), tokens(POSITIONS - 1)) for _ in range(32)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs per path and kind (the best is reported)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_eval_scoring.json"))
    args = parser.parse_args()

    import torch
    import transformers as T
    from lm_eval.models.huggingface import HFLM

    from normswap.checkpoint.source import example_model_path
    from normswap.evaluation.shared_context import SharedContextHFLM

    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=POSITIONS, vocab_size=VOCAB)
    model = T.GPT2LMHeadModel(config).eval()
    tokenizer = T.AutoTokenizer.from_pretrained(example_model_path())
    paths = {"hflm": HFLM, "normswap": SharedContextHFLM}
    models = {name: cls(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size, max_length=POSITIONS)
              for name, cls in paths.items()}
    rows = {}
    for kind, batch in requests().items():
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, lm in models.items():
                start = time.perf_counter()
                lm._loglikelihood_tokens(batch, disable_tqdm=True)
                seconds[name].append(time.perf_counter() - start)
        best = {name: round(min(values), 3) for name, values in seconds.items()}
        rows[kind] = {"requests": len(batch), **best, "ratio": round(best["normswap"] / best["hflm"], 3),
                      "runs": {name: [round(v, 3) for v in values] for name, values in seconds.items()}}
        print(f"{kind:9s} {len(batch):4d} requests  HFLM {best['hflm']:7.3f} s  normswap {best['normswap']:7.3f} s"
              f"  ratio {rows[kind]['ratio']:.3f}")
    result = {"command": "python " + " ".join(["scripts/bench_eval_scoring.py", *sys.argv[1:]]),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__, "threads": torch.get_num_threads()},
              "model": {"n_layer": 4, "n_embd": 256, "vocab_size": VOCAB, "positions": POSITIONS,
                        "batch_size": args.batch_size},
              "kinds": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
