"""The hub path end to end, offline: ``normswap convert gpt2`` against a local hub over HTTP.

``hubserver.FakeHub`` serves, on 127.0.0.1, a repo laid out like the real ``gpt2`` one: base-model
tensor names, both ``model.safetensors`` and ``pytorch_model.bin``, tokenizer files, and large
files normswap must not fetch (TensorFlow, Flax, Rust and ONNX weights). The real
``huggingface_hub`` download code talks to it through ``HF_ENDPOINT``; the commands run in a
subprocess, as a user types them, because ``huggingface_hub`` reads its endpoint at import.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import make_hard
from hub_datasets import DATASETS, add_all
from hubserver import FakeHub, folder_files
from safetensors.torch import save
from transformers import GPT2Config, GPT2Model

from normswap.checkpoint.source import example_model_path
from normswap.evaluation.recipe import RECIPES_DIR, load_recipe

# every test starts the CLI in a fresh interpreter (torch and transformers imported each time)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOT_NEEDED = ("tf_model.h5", "flax_model.msgpack", "rust_model.ot", "onnx/decoder_model.onnx", "onnx/config.json",
              "64-8bits.tflite", "pytorch_model.bin")


def gpt2_like_repo(seed: int = 0, **overrides) -> dict[str, bytes]:
    """A tiny GPT-2 in the layout of the hub's ``gpt2`` repo (``GPT2Model`` names, no ``transformer.``)."""
    bundled = example_model_path()
    # GPT-2's context (1024), so that normswap/recipes/gpt2.yaml runs with its own max_length
    settings = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=2048, n_positions=1024, bos_token_id=0, eos_token_id=0)
    settings.update(overrides)
    config = GPT2Config(architectures=["GPT2LMHeadModel"], **settings)
    torch.manual_seed(seed)
    state = {k: v.contiguous() for k, v in make_hard(GPT2Model(config), seed).state_dict().items()}
    pickled = io.BytesIO()
    torch.save(state, pickled)
    return {
        "config.json": config.to_json_string().encode(),
        "generation_config.json": b'{"bos_token_id": 0, "eos_token_id": 0}',
        "model.safetensors": save(state),
        "pytorch_model.bin": pickled.getvalue(),
        "tokenizer.json": (bundled / "tokenizer.json").read_bytes(),
        "tokenizer_config.json": (bundled / "tokenizer_config.json").read_bytes(),
        "README.md": b"---\nlicense: mit\n---\n# tiny gpt2\n",
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        # large files of other frameworks, which a conversion never needs
        "tf_model.h5": b"\0" * 4096,
        "flax_model.msgpack": b"\0" * 4096,
        "rust_model.ot": b"\0" * 4096,
        "64-8bits.tflite": b"\0" * 4096,
        "onnx/config.json": b"{}",
        "onnx/decoder_model.onnx": b"\0" * 4096,
    }


@pytest.fixture(scope="module")
def hub():
    with FakeHub() as server:
        repo = server.add("gpt2", gpt2_like_repo(seed=0))
        server.first_commit = next(iter(repo.commits))
        repo.commit(gpt2_like_repo(seed=1))  # main moves on; the first commit stays reachable by its sha
        server.add("some-org/gated-401", gpt2_like_repo(), gated=401)
        server.add("some-org/gated-403", gpt2_like_repo(), gated=403)
        server.add("some-org/dropped", gpt2_like_repo(), drop=True)
        yield server


def normswap_cli(*args: str, hub: FakeHub | None, home: Path, cwd: Path, offline: bool = False,
                 endpoint: str | None = None, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """``normswap *args`` against ``hub``; ``env`` sets variables (None: unset)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    base.update(PYTHONPATH=str(ROOT), HF_HOME=str(home), HF_HUB_DISABLE_PROGRESS_BARS="1",
                HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    base["HF_ENDPOINT"] = endpoint or (hub.endpoint if hub else "http://127.0.0.1:9")
    if offline:
        base["HF_HUB_OFFLINE"] = "1"
    for key, value in (env or {}).items():
        base.pop(key, None)
        if value is not None:
            base[key] = value
    env = base
    return subprocess.run([sys.executable, "-m", "normswap.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def one_line(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_convert_gpt2_downloads_only_what_it_needs_then_uses_the_cache(hub, tmp_path):
    home = tmp_path / "hf"
    hub.log.clear()
    result = normswap_cli("convert", "gpt2", "--out", "gpt2-rms", hub=hub, home=home, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "gpt2-rms"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    # the card names its source and copies the source card's license
    assert 'base_model: "gpt2"\nlicense: "mit"\npipeline_tag: "text-generation"\n' in (out / "README.md").read_text()
    fetched = hub.downloads("gpt2")
    assert "model.safetensors" in fetched and "config.json" in fetched and "tokenizer.json" in fetched
    assert not set(fetched) & set(NOT_NEEDED), fetched
    assert len(fetched) == len(set(fetched))
    # the snapshot is the commit main points at
    snapshots = list((home / "hub" / "models--gpt2" / "snapshots").iterdir())
    assert [s.name for s in snapshots] == [hub.repos[("model", "gpt2")].refs["main"]]

    hub.log.clear()
    # the repeats prove where the files come from; the first run has verified the conversion
    again = normswap_cli("convert", "gpt2", "--out", "gpt2-rms-2", "--verify", "none", hub=hub, home=home, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert hub.downloads("gpt2") == []  # every file came from the cache

    offline = normswap_cli("convert", "gpt2", "--out", "gpt2-rms-3", "--verify", "none", hub=None, home=home,
                           cwd=tmp_path, offline=True)
    assert offline.returncode == 0, offline.stderr  # offline mode reads the cache


def test_revision_pins_a_commit(hub, tmp_path):
    result = normswap_cli("convert", "gpt2", "--revision", hub.first_commit, "--out", "pinned", "--verify", "none",
                          hub=hub, home=tmp_path / "hf", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    snapshots = [p.name for p in (tmp_path / "hf" / "hub" / "models--gpt2" / "snapshots").iterdir()]
    assert snapshots == [hub.first_commit]
    bad = normswap_cli("convert", "gpt2", "--revision", "no-such-branch", "--out", "x", hub=hub,
                       home=tmp_path / "hf", cwd=tmp_path)
    one_line(bad, "could not fetch 'gpt2'", "no-such-branch")


def test_bin_only_repo_falls_back_to_pickled_weights(tmp_path):
    files = gpt2_like_repo()
    del files["model.safetensors"]
    with FakeHub() as hub:
        hub.add("some-org/bin-only", files)
        result = normswap_cli("convert", "some-org/bin-only", "--out", "out", hub=hub, home=tmp_path / "hf",
                              cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        fetched = hub.downloads()
    assert "pytorch_model.bin" in fetched and not {"tf_model.h5", "flax_model.msgpack"} & set(fetched)


@pytest.mark.parametrize("repo, needles", [
    ("some-org/no-such-model", ("could not fetch 'some-org/no-such-model'", "not found")),
    ("some-org/gated-401", ("could not fetch 'some-org/gated-401'", "gated")),
    ("some-org/gated-403", ("could not fetch 'some-org/gated-403'", "gated")),
    ("some-org/dropped", ("could not fetch 'some-org/dropped'",)),
])
def test_hub_failures_are_one_line(hub, tmp_path, repo, needles):
    result = normswap_cli("convert", repo, "--out", "out", hub=hub, home=tmp_path / "hf", cwd=tmp_path)
    one_line(result, *needles)
    assert not (tmp_path / "out").exists()


def test_offline_and_unreachable_are_one_line(tmp_path):
    offline = normswap_cli("convert", "gpt2", "--out", "out", hub=None, home=tmp_path / "hf", cwd=tmp_path, offline=True)
    one_line(offline, "could not fetch 'gpt2'", "offline")
    unreachable = normswap_cli("convert", "gpt2", "--out", "out", hub=None, home=tmp_path / "hf", cwd=tmp_path)
    one_line(unreachable, "could not fetch 'gpt2'", "unreachable")


def test_gpt2_recipe_runs_literally_against_the_local_hub(hub, tmp_path):
    """``normswap run gpt2 --limit 3``: the model and every dataset of the recipe come
    from the local hub (stand-in rows, see ``hub_datasets``); the report shows the published
    anchors beside the measured values."""
    add_all(hub)
    hub.log.clear()
    result = normswap_cli("run", str(RECIPES_DIR / "gpt2.yaml"), "--limit", "3", "--device", "cpu", "--out", "run",
                          "--no-progress", hub=hub, home=tmp_path / "hf", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = result.stdout
    assert "## Comparison: PASS" in report and "## Reference figures" in report
    for key in ("lambada_openai/acc", "hellaswag/acc_norm", "piqa/acc", "arc_easy/acc", "winogrande/acc",
                "wikitext/word_perplexity", "strided/token_perplexity"):
        assert f"| {key} |" in report, key
    assert "| 29.94 |" in report  # the published strided WikiText-2 perplexity, beside ours
    served = {path.split("/resolve/")[0].removeprefix("/datasets/") for method, path in hub.log
              if method == "GET" and path.startswith("/datasets/")}
    assert set(DATASETS) <= served


HUB_RECIPES = sorted(p for p in RECIPES_DIR.glob("*.yaml") if not load_recipe(p).source.startswith("normswap:"))


# gpt2.yaml runs literally above
@pytest.mark.parametrize("recipe_path", HUB_RECIPES, ids=[p.stem for p in HUB_RECIPES])
def test_hub_recipes_convert_and_evaluate_through_the_local_hub(recipe_path, tmp_path):
    """Each hub recipe's source, conversion and verification settings, run against a tiny model of
    the recipe's family served under the recipe's repo id; evaluation on a short local text (the
    recipes' standard datasets are not served)."""
    recipe = load_recipe(recipe_path)
    family = {"gpt2": "gpt2", "facebook/opt-125m": "opt", "EleutherAI/pythia-160m": "gpt_neox",
              "bigscience/bloom-560m": "bloom"}.get(recipe.source)
    if family is None:
        pytest.skip(f"no tiny stand-in for {recipe.source}")
    model_dir = tiny_family(family, tmp_path / "model")
    data = yaml.safe_load(recipe_path.read_text())
    text = tmp_path / "short.txt"
    excerpt = (example_model_path().parent / "text" / "persuasion-excerpt.txt").read_text(encoding="utf-8")
    text.write_text(excerpt[20_000:21_500], encoding="utf-8")
    data["eval"] = {"dtype": "float32", "batch_size": 4, "max_length": 32, "text": str(text), "tasks": [],
                    "perplexity": True}
    data.pop("reference", None)
    local = tmp_path / f"{recipe_path.stem}.yaml"
    local.write_text(yaml.safe_dump(data))
    with FakeHub() as hub:
        hub.add(recipe.source, folder_files(model_dir))
        result = normswap_cli("run", str(local), "--out", "run", "--device", "cpu", hub=hub,
                              home=tmp_path / "hf", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "## Comparison: PASS" in result.stdout
    assert (tmp_path / "run" / "converted" / "model.safetensors").is_file()


def tiny_family(family: str, path: Path) -> Path:
    """A tiny random checkpoint of ``family`` with the bundled tokenizer (vocabulary 2048)."""
    import transformers as T

    common = dict(vocab_size=2048, bos_token_id=0, eos_token_id=0)
    if family == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, **common))
    elif family == "opt":
        model = T.OPTForCausalLM(T.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=37,
                                             word_embed_proj_dim=32, max_position_embeddings=64, pad_token_id=1,
                                             **common))
    elif family == "gpt_neox":
        model = T.GPTNeoXForCausalLM(T.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                     intermediate_size=37, max_position_embeddings=64, **common))
    else:
        model = T.BloomForCausalLM(T.BloomConfig(n_layer=2, hidden_size=32, n_head=4, **common))
        model.config.seq_length = 64
    torch.manual_seed(0)
    make_hard(model).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((example_model_path() / name).read_bytes())
    return path
