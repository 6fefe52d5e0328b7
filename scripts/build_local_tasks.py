"""Build the offline lm-eval tasks in normswap/evals/data/ from public-domain text.

    python scripts/build_local_tasks.py [--source normswap/data/text/persuasion-excerpt.txt]

Writes three JSONL files (deterministic for a given source and seed). The text keeps its hard
line wraps: the example model learnt them, and unwrapped lines make it predict newlines.

- ``persuasion_rolling.jsonl``: ``{"text"}`` 48 evenly spaced documents of about 4,000 characters, for
  lm-eval's rolling loglikelihood (word perplexity, byte perplexity, bits per byte);
- ``persuasion_lastword.jsonl``: ``{"text"}`` LAMBADA-style passages of 40-120 words ending in a
  word that already occurred earlier in the passage (LAMBADA keeps passages whose last word needs
  the broad context; a word seen before is a cheap proxy for that), scored like lambada_openai;
- ``persuasion_cloze.jsonl``: ``{"context", "choices", "label"}`` multiple-choice cloze: a content
  word in the middle of a sentence is blanked; each choice is a candidate word followed by the rest
  of the sentence. Distractors are words from the same text with a similar frequency rank, so
  word frequency alone does not give the answer away.

The shipped files were built from the whole of Jane Austen's *Persuasion* (1818, public domain),
the novel held out from the bundled example model's training (the package bundles a 60 kB excerpt
of it), with the full text of the novel as the source (a UTF-8 plain text, e.g. Project Gutenberg ebook 105):

    python scripts/build_local_tasks.py --source PATH/TO/persuasion.txt

Without ``--source`` the bundled excerpt is used, which gives smaller tasks.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SOURCE = HERE.parent / "normswap" / "data" / "text" / "persuasion-excerpt.txt"
SEED = 1818
ROLLING_DOC_CHARS = 4000
MAX_ROLLING_DOCS = 48
# Frequent function words make trivial cloze targets; skip them.
STOPWORDS = set(
    """the and for that with was were have had has not but his her him she they them their this
    from which would could should been being there then than when what who whom whose will shall
    into upon very much more most such some any only other over also your yours ours mine myself
    herself himself itself themselves said says just like well""".split()
)
WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


def paragraphs(text: str) -> list[str]:
    """Paragraphs (blocks between blank lines), stripped, their hard line wraps kept.

    The wraps stay because the example model learnt them: a passage unwrapped into one long line
    makes it predict a newline where the text has a word.
    """
    blocks = re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n"))
    return ["\n".join(line.strip() for line in block.strip().splitlines()) for block in blocks if block.strip()]


def evenly(rows: list[dict], count: int) -> list[dict]:
    """At most ``count`` rows, evenly spaced over the whole text rather than its first chapters."""
    step = max(1.0, len(rows) / count)
    return [rows[int(i * step)] for i in range(min(count, len(rows)))]


def rolling_documents(paras: list[str]) -> list[dict]:
    docs, current, size = [], [], 0
    for para in paras:
        current.append(para)
        size += len(para) + 2
        if size >= ROLLING_DOC_CHARS:
            docs.append({"text": "\n\n".join(current)})
            current, size = [], 0
    if current:
        docs.append({"text": "\n\n".join(current)})
    return docs


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the sentences of ``text`` (split after . ! ? + whitespace)."""
    spans, start = [], 0
    for match in re.finditer(r"[.!?][\"']?(?=\s)", text):
        end = match.end()
        if text[start:end].strip():
            spans.append((start, end))
        start = end
        while start < len(text) and text[start].isspace():
            start += 1
    return spans


def lastword_passages(text: str, spans: list[tuple[int, int]], rng: random.Random) -> list[dict]:
    """Passages of whole sentences ending in a word already seen in the passage."""
    docs = []
    i = 0
    while i < len(spans):
        n_words = rng.randint(40, 120)
        j = i
        while j < len(spans) and len(text[spans[i][0] : spans[j][1]].split()) < n_words:
            j += 1
        j = min(j, len(spans) - 1)
        passage = text[spans[i][0] : spans[j][1]]
        i = j + 1
        # Cut the closing punctuation so the passage ends in a word, as LAMBADA does; the task
        # splits context and target at the last space, so the word must follow a space.
        passage = re.sub(r"[^A-Za-z]+$", "", passage)
        context, _, target = passage.rpartition(" ")
        seen = {w.lower() for w in WORD.findall(context)}
        if (len(context.split()) >= 30 and "\n" not in target and target.isalpha() and len(target) >= 3
                and target.lower() in seen):
            docs.append({"text": passage})
    return docs


def cloze_items(text: str, spans: list[tuple[int, int]], rng: random.Random, max_items: int = 400) -> list[dict]:
    """Multiple-choice cloze items with three distractors of similar frequency rank."""
    # Lower-case words only: proper names (Anne, Wentworth) would be too easy to rule out.
    counts = Counter(w for w in WORD.findall(text) if w.islower())
    candidates = [w for w, c in counts.most_common() if w.isalpha() and len(w) >= 4 and w not in STOPWORDS and c >= 3]
    rank = {w: r for r, w in enumerate(candidates)}
    items = []
    for k in range(2, len(spans)):
        start, end = spans[k]
        # Blanks preceded by a space (lm-eval joins context and choice with one) and followed by
        # whitespace, at least the 4th word and with 3 words after it, so both sides inform.
        blanks = [m for m in re.finditer(r"(?<= )([a-z]+)(?=\s)", text[start:end]) if m.group(1) in rank]
        n_words = len(text[start:end].split())
        blanks = [m for m in blanks if 3 <= len(text[start : start + m.start()].split()) <= n_words - 4]
        if not blanks:
            continue
        blank = rng.choice(blanks)
        target = blank.group(1)
        r = rank[target]
        in_sentence = {w.lower() for w in WORD.findall(text[start:end])}
        pool = [w for w in candidates[max(0, r - 40) : r + 40] if w != target and w not in in_sentence]
        if len(pool) < 3:
            continue
        distractors = rng.sample(pool, 3)
        blank_at = start + blank.start()
        # Up to 400 characters of preceding text (from two sentences back), cut at whitespace.
        context = text[max(spans[k - 2][0], blank_at - 400) : blank_at - 1]
        context = context[context.find(" ") + 1 :] if blank_at - 400 > spans[k - 2][0] else context
        rest = text[blank_at + len(target) : end]
        choices = [w + rest for w in [target, *distractors]]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(target + rest)})
    return evenly(items, max_items)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="UTF-8 text to build from")
    parser.add_argument("--out", type=Path, default=HERE.parent / "normswap" / "evals" / "data")
    args = parser.parse_args()
    text = args.source.read_text(encoding="utf-8")
    paras = paragraphs(text)
    joined = "\n\n".join(paras)
    spans = sentence_spans(joined)
    args.out.mkdir(parents=True, exist_ok=True)
    built = {
        "persuasion_rolling": evenly(rolling_documents(paras), MAX_ROLLING_DOCS),
        "persuasion_lastword": lastword_passages(joined, spans, random.Random(SEED)),
        "persuasion_cloze": cloze_items(joined, spans, random.Random(SEED + 1)),
    }
    for name, rows in built.items():
        write_jsonl(args.out / f"{name}.jsonl", rows)
        print(f"{name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
