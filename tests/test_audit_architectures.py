"""The coverage audit: its classifier measures pre-LN and post-LN blocks; its cached results
cover transformers' whole registry; the table in docs/architectures.md and the count in README.md
are what the results and the adapters give; every refusal's reason is measured; and (slow) every
supported family still measures pre-LN."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from normswap.architectures import ARCHITECTURES, POST_LN

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def audit():
    return _load("audit_architectures")


@pytest.fixture(scope="module")
def measure():
    return _load("audit_measure").measure


@pytest.fixture(scope="module")
def results(audit):
    return audit.load_results()


@pytest.fixture(scope="module")
def rows(results):
    return {row["model_type"]: row for row in results["rows"]}


@pytest.mark.parametrize(("model_type", "shift"), [("gpt2", 1.0), ("bert", 0.0)])
def test_the_one_direction_tells_pre_ln_from_post_ln(measure, model_type, shift):
    row = measure(model_type)
    assert row["centring_norms"] and set(row["shifts"].values()) == {shift}, row


def test_a_norm_switch_is_measured_as_a_variant(measure):
    row = measure("opt")
    assert row["shifts"] == {"decoder.layers": 1.0}
    assert row["variants"]["do_layer_norm_before=False"] == {"decoder.layers": 0.0}


def test_results_cover_the_installed_registry(results):
    import transformers
    from transformers import CONFIG_MAPPING

    assert results["transformers"] == transformers.__version__, \
        "transformers changed: rerun `nice -n 10 python3 scripts/audit_architectures.py --resume`"
    # normswap's own output types (normswap_bloom, ...) are registered once normswap loads a model
    registry = {name for name in CONFIG_MAPPING.keys() if not name.startswith("normswap_")}
    assert {row["model_type"] for row in results["rows"]} == registry


def test_docs_and_readme_are_generated_from_the_results(audit, results):
    docs = (ROOT / "docs" / "architectures.md").read_text(encoding="utf-8")
    assert docs[docs.index(audit.BEGIN) + len(audit.BEGIN):docs.index(audit.END)].strip() == audit.table(results)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    count = readme[readme.index(audit.COUNT_BEGIN) + len(audit.COUNT_BEGIN):readme.index(audit.COUNT_END)]
    listed = audit.classified(results["rows"])
    assert count.strip() == audit.count_line(listed, len(results["rows"])) + "."


def test_every_adapter_is_listed_exact_and_measured_pre_ln(audit, rows):
    listed = {row["model_type"]: row for row in audit.classified(list(rows.values()))}
    for model_type in ARCHITECTURES:
        if model_type.startswith("clip_"):  # CLIP's towers under their own types: the clip row covers them
            continue
        assert listed[model_type]["status"] == "exact", model_type
        assert set(rows[model_type]["shifts"].values()) == {1.0}, rows[model_type]


def test_every_refusal_is_measured(rows):
    """A post-LN refusal's reason is the measurement; T5's norm measures as no centring norm."""
    for model_type, reason in POST_LN.items():
        row = rows[model_type]
        if "post-LN" in reason:
            assert row["shifts"] and set(row["shifts"].values()) == {0.0}, row
        else:
            assert row["centring_norms"] == 0, row


@pytest.mark.slow
def test_every_supported_family_still_measures_pre_ln(measure):
    for model_type in sorted({architecture.model_types[0] for architecture in ARCHITECTURES.values()}):
        row = measure(model_type)
        assert row.get("shifts") and set(row["shifts"].values()) == {1.0}, row
