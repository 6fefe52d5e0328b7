"""A run of the suite leaves the repository as it found it: benchmark results are committed
figures, so a test that wrote one into benchmarks/results/ fails the run (tests/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import conftest
import pytest


class Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str, **markup) -> None:
        self.lines.append(text)


def fake_session() -> SimpleNamespace:
    writer = Writer()
    config = SimpleNamespace(stash=pytest.Stash(), get_terminal_writer=lambda: writer, writer=writer)
    return SimpleNamespace(config=config, exitstatus=pytest.ExitCode.OK)


def test_a_file_written_into_benchmark_results_fails_the_run(tmp_path, monkeypatch):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "committed.json").write_text("{}")
    monkeypatch.setattr(conftest, "RESULTS", results)
    session = fake_session()
    conftest.pytest_sessionstart(session)
    conftest.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.OK  # nothing new: the run stands
    (results / "bench_generate-cpu.json").write_text("{}")
    conftest.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    assert "benchmarks/results/bench_generate-cpu.json" in session.config.writer.lines[0]
