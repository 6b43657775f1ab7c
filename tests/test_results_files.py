"""Every results file README.md and docs/ point to is in the repository and parses (issue 28
item 2, the part that can be checked): a table's numbers can be traced to the file that holds
them. Paths are `docs/results/...` (from the repository root, as README.md and
benchmarks/README.md write them) or `results/...` (relative to the document: from docs/, as the
docs' own links write them; anywhere else such a path points to no results file and fails). A
path that only ever appears as a command's `--out` / `--out-dir` is where a rerun would write (a
withdrawn run's command keeps one), not a citation, and need not exist yet; one written as
`git show COMMIT:docs/results/RUN/FILE` is an artefact that left the tree, and RUN's manifest must
record it as removed at that commit (or the file is still in the tree: an earlier version of it).

Every run folder's MANIFEST.json (scripts/results_manifest.py) lists each artefact beside it with
its size and sha256; per-request files are committed gzipped (`*.jsonl.gz`)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from pathlib import Path

import pytest

from eval.linearkv.records import load_records

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_PATH = re.compile(r"(?<![\w/.-])((?:docs/)?results/[A-Za-z0-9_.\-/]+)")
_OUT_FLAG = re.compile(r"--out(?:-dir)?[ =]+$")   # right before a path: the command writes there
_GIT_SHOW = re.compile(r"git show ([0-9a-f]{7,40}):$")  # right before a path: an artefact that left the tree
_spec = importlib.util.spec_from_file_location("results_manifest", ROOT / "scripts" / "results_manifest.py")
manifest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(manifest)   # type: ignore[union-attr]


def _referenced() -> dict[Path, list[str]]:
    found: dict[Path, list[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        for match in _PATH.finditer(text):
            raw = match.group(1)
            rel = raw.rstrip(".,;:")
            path = ROOT / rel if rel.startswith("docs/") else doc.parent / rel
            before = text[max(0, match.start() - 60):match.start()]
            if _GIT_SHOW.search(before):
                continue   # checked by test_removed_artefacts_cited_by_commit_are_in_their_manifest
            out = "--out " if _OUT_FLAG.search(before[-16:]) else ""
            found.setdefault(path, []).append(f"{doc.relative_to(ROOT)}: {out}{raw}")
    return found


def _history_citations() -> list[tuple[str, str, Path]]:
    found = []
    for doc in DOCS:
        for match in re.finditer(r"git show ([0-9a-f]{7,40}):(docs/results/[A-Za-z0-9_.\-/]+)", doc.read_text()):
            found.append((str(doc.relative_to(ROOT)), match.group(1), ROOT / match.group(2).rstrip(".,;:")))
    return found


def test_docs_point_to_results_files():
    assert len(_referenced()) >= 20   # the scan finds the docs' results links


def test_every_referenced_results_path_exists():
    missing = {str(p.relative_to(ROOT)): where for p, where in _referenced().items()
               if not p.exists() and not all(": --out " in w for w in where)}
    assert not missing, missing


def _results_files() -> list[Path]:
    out: set[Path] = set()
    for path in _referenced():
        if path.is_dir():
            out.update(p for p in path.rglob("*") if _is_data(p))
        elif _is_data(path):
            out.add(path)
        elif path.exists():   # a table: the JSON / JSONL files beside it
            out.update(p for p in path.parent.glob("*") if _is_data(p))
    return sorted(out)


def _is_data(path: Path) -> bool:
    return path.name.endswith((".json", ".jsonl", ".jsonl.gz")) and path.name != manifest.NAME


@pytest.mark.parametrize("path", _results_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_results_file_parses(path: Path):
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    if path.suffix == ".json":
        json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        assert rows, f"{path} is empty"


@pytest.mark.parametrize("folder", manifest.run_folders(), ids=lambda p: str(p.relative_to(ROOT)))
def test_manifest_matches_the_run_folder(folder: Path):
    assert not manifest.problems(folder), "\n".join(manifest.problems(folder))


def test_manifest_check_names_a_changed_missing_or_unlisted_artefact(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "ROOT", tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    assert manifest.problems(run) == ["run/MANIFEST.json: no manifest (run scripts/results_manifest.py --write)"]
    (run / "report.json").write_text("{}")
    (run / "report.md").write_text("x")
    manifest.write(run, removed=["requests-0.jsonl"], commit="abc1234")
    assert manifest.problems(run) == []
    (run / "report.md").write_text("y")
    (run / "new.png").write_bytes(b"")
    (run / "report.json").unlink()
    found = manifest.problems(run)
    assert found[:2] == ["run/new.png: in the folder, not in MANIFEST.json",
                         "run/report.json: in MANIFEST.json, not in the folder"]
    assert [m.split(" ")[:2] for m in found[2:]] == [["run/report.md:", "sha256"]]
    manifest.write(run)   # the removal recorded before is kept
    assert manifest.read(run)["removed"] == [{"commit": "abc1234", "files": ["requests-0.jsonl"]}]


def test_results_stay_small_and_per_request_files_gzipped():
    files = [p for p in (ROOT / "docs" / "results").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 8_000_000
    assert not [p for p in files if p.suffix == ".jsonl"], "per-request files are committed as .jsonl.gz"


def test_removed_artefacts_cited_by_commit_are_in_their_manifest():
    cited = _history_citations()
    assert cited   # the LinearKV replay records are cited by commit
    for doc, commit, path in cited:
        if path.is_file():
            continue   # an earlier version of an artefact still in the tree
        removed = manifest.read(path.parent).get("removed", [])
        assert any(commit.startswith(h["commit"][:len(commit)]) and path.name in h["files"] for h in removed), \
            f"{doc}: git show {commit}:{path.relative_to(ROOT)} is not recorded as removed in its manifest"


def test_linearkv_reference_records_read_from_the_committed_gzip():
    records = load_records(ROOT / "docs" / "results" / "linearkv" / "results.jsonl.gz")
    assert len(records) > 100 and all(r["key"] == k for k, r in records.items())
