"""The coverage audit: its classifier measures pre-LN and post-LN blocks, and the table in
docs/architectures.md agrees with the adapters (a family the docs call exact has an adapter,
and every adapter's family is listed as exact)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from normswap.architectures import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def audit():
    spec = importlib.util.spec_from_file_location("audit_architectures", ROOT / "scripts" / "audit_architectures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("model_type", "status", "shift"),
                         [("gpt2", "exact", 1.0), ("mbart", "exact", 1.0), ("bert", "refused", 0.0)])
def test_the_one_direction_tells_pre_ln_from_post_ln(audit, model_type, status, shift):
    row = audit.classify(model_type)
    assert row["status"] == status and abs(row["shift"] - shift) < 1e-6


def test_docs_table_agrees_with_the_adapters(audit):
    text = (ROOT / "docs" / "architectures.md").read_text(encoding="utf-8")
    table = text[text.index(audit.BEGIN):text.index(audit.END)]
    exact = set(re.findall(r"^\| (\S+) \| exact \|", table, flags=re.M))
    families = {model_type for model_type in ARCHITECTURES if not model_type.startswith("clip_")}
    assert exact <= set(ARCHITECTURES) and families <= exact, sorted(families ^ exact)
    listed = set(re.findall(r"^\| (\S+) \| (?:exact|refused|not yet) \|", table, flags=re.M))
    assert "bert" in listed and "mbart" in exact and "pegasus" in exact


@pytest.mark.slow
def test_every_adapter_family_is_measured_pre_ln(audit):
    for architecture in {id(a): a for a in ARCHITECTURES.values()}.values():
        row = audit.classify(architecture.model_types[0])
        assert row["status"] == "exact", row
        assert row["shift"] is None or abs(row["shift"] - 1) < 1e-6 or architecture.model_types[0] in ("whisper",), row
