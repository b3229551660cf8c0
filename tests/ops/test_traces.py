"""The benchmark traces ship in traces/: every command the docs give finds its file in a
clone, the benches' defaults point there, and the files are the ones traces/README.md
describes (its sha256 table)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "traces"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_trace_the_docs_name_is_in_the_repository() -> None:
    named = {m for doc in DOCS for m in re.findall(r"\btraces/[\w.-]+\.(?:csv|jsonl|json)\b",
                                                   doc.read_text())}
    assert named, "the docs name no trace"
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, missing


def test_no_doc_points_outside_the_project() -> None:
    for doc in [*DOCS, TRACES / "README.md"]:
        assert "../shared" not in doc.read_text(), doc


def test_trace_files_match_their_readme_checksums() -> None:
    table = dict(re.findall(r"^\| ([\w.-]+) \| `([0-9a-f]{64})` \|$",
                            (TRACES / "README.md").read_text(), re.M))
    assert len(table) == 6
    for name, digest in table.items():
        assert hashlib.sha256((TRACES / name).read_bytes()).hexdigest() == digest, name
    assert sorted(p.name for p in (TRACES / "LICENSES").iterdir()) == [
        "LICENSE.AzurePublicDataset.CC-BY-4.0", "LICENSE.FastChat.Apache-2.0",
        "LICENSE.Mooncake.Apache-2.0", "LICENSE.ml-energy-leaderboard-v2.Apache-2.0"]


def test_bench_defaults_read_the_shipped_traces() -> None:
    from bench import scheduler_latency as bench

    assert Path(bench.DEFAULT_TRACE) == TRACES / "mooncake_conversation_min00-30.jsonl"
    assert Path(bench.DEFAULT_TRACE).is_file()
