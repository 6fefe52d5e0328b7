"""Stand-ins for the hub datasets behind ``normswap/recipes/gpt2.yaml``, for ``hubserver.FakeHub``.

Each is a dataset repo laid out as ``datasets`` expects of the hub (a ``README.md`` whose YAML
``configs`` name parquet files per split), with the repo id, config name, split and fields that
lm-eval's task (or normswap's ``--text wikitext-2-raw-v1``) reads, and three invented rows.
"""

from __future__ import annotations

import io

import yaml

SENTENCES = [
    "Anne walked down to the shore with her sister and watched the boats come in",
    "The letter had been written in a hurry and was sent by the morning post",
    "Captain Wentworth said nothing for a while and then looked towards the window",
]

# repo id -> (config name or None, the splits lm-eval reads (few-shot ones included), rows)
DATASETS: dict[str, tuple[str | None, tuple[str, ...], list[dict]]] = {
    "EleutherAI/lambada_openai": ("default", ("test",), [{"text": s} for s in SENTENCES]),
    "Rowan/hellaswag": (None, ("train", "validation"), [
        {"ind": i, "activity_label": "Walking", "ctx_a": s, "ctx_b": "then", "ctx": s + " then",
         "endings": ["she stopped.", "he ran.", "they sat.", "it rained."], "source_id": f"x{i}",
         "split": "val", "split_type": "indomain", "label": str(i % 4)}
        for i, s in enumerate(SENTENCES)]),
    "baber/piqa": (None, ("train", "validation"), [
        {"goal": s, "sol1": "Open the door.", "sol2": "Close the window.", "label": i % 2}
        for i, s in enumerate(SENTENCES)]),
    "allenai/ai2_arc": ("ARC-Easy", ("train", "validation", "test"), [
        {"id": f"q{i}", "question": f"What happened? {s}",
         "choices": {"text": ["a walk", "a letter", "a boat", "a window"], "label": ["A", "B", "C", "D"]},
         "answerKey": "ABCD"[i % 4]}
        for i, s in enumerate(SENTENCES)]),
    "allenai/winogrande": ("winogrande_xl", ("train", "validation"), [
        {"sentence": "Anne gave the letter to Mary because _ was leaving.", "option1": "Anne", "option2": "Mary",
         "answer": str(1 + i % 2)}
        for i in range(3)]),
    "EleutherAI/wikitext_document_level": ("wikitext-2-raw-v1", ("train", "validation", "test"), [
        {"page": " = Persuasion = \n " + " . ".join(SENTENCES) + " . \n"} for _ in range(2)]),
    "Salesforce/wikitext": ("wikitext-2-raw-v1", ("test",), [{"text": line} for line in
                                                           ["", " = Persuasion = ", "", *SENTENCES, ""]]),
}


def dataset_repo(config: str | None, splits: tuple[str, ...], rows: list[dict]) -> dict[str, bytes]:
    """Files of a parquet dataset repo with one config whose splits all hold ``rows``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = config or "default"
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    files, data_files = {}, []
    for split in splits:
        path = f"{name}/{split}-00000-of-00001.parquet"
        files[path] = buffer.getvalue()
        data_files.append({"split": split, "path": path})
    card = {"configs": [{"config_name": name, "data_files": data_files}]}
    files["README.md"] = f"---\n{yaml.safe_dump(card, sort_keys=False)}---\n# stand-in dataset\n".encode()
    return files


def add_all(hub) -> None:
    """Serve every dataset of ``DATASETS`` from ``hub``."""
    for repo_id, (config, splits, rows) in DATASETS.items():
        hub.add(repo_id, dataset_repo(config, splits, rows), kind="dataset")
