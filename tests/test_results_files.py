"""Every results file README.md and docs/ point to is in the repository and parses (the
part that can be checked): a table's numbers can be traced to the file that holds
them. Paths are `docs/results/...` (from the repository root, as README.md and
benchmarks/README.md write them) or `results/...` (relative to the document: from docs/, as the
docs' own links write them; anywhere else such a path points to no results file and fails). A
path that only ever appears as a command's `--out` / `--out-dir` is where a rerun would write (a
withdrawn run's command keeps one), not a citation, and need not exist yet; one written as
`git show COMMIT:docs/results/RUN/FILE` (or `COMMIT:docs/results/RUN/FILE`, as a historical table's
comment and the commands reading superseded runs write it) is an artefact that left the tree: that
commit must hold it, and where RUN's folder is still in the tree its manifest must record the file
as removed at that commit (or the file is still in the tree: an earlier version of it). A superseded
run leaves the tree whole; the documents cite it by commit.

Every run folder's MANIFEST.json (scripts/results_manifest.py) lists each artefact beside it with
its size and sha256; per-request files are committed gzipped (`*.jsonl.gz`)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from eval.linearkv.records import load_records

ROOT = Path(__file__).resolve().parents[1]
#: experiment logs beside their results (`docs/results/RUN/NOTES.md`) write every results path from
#: the repository root (`docs/results/...`); their links are relative to the run folder (`../RUN/...`)
NOTES = sorted((ROOT / "docs" / "results").rglob("NOTES.md"))
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md")), *NOTES]
_PATH = re.compile(r"(?<![\w/.-])((?:docs/)?results/[A-Za-z0-9_.\-/]+)")
_OUT_FLAG = re.compile(r"--out(?:-dir)?[ =]+$")   # right before a path: the command writes there
_GIT_SHOW = re.compile(r"(?<![\w])([0-9a-f]{7,40}):$")  # right before a path: an artefact that left the tree
_GIT_PATH = re.compile(r"(?<![\w])([0-9a-f]{7,40}):(docs/results/[A-Za-z0-9_.\-/]+)")
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
        for match in _GIT_PATH.finditer(doc.read_text()):
            found.append((str(doc.relative_to(ROOT)), match.group(1), match.group(2).rstrip(".,;:")))
    return found


@cache
def _git_show(commit: str, rel: str) -> bytes:
    """The file `rel` (from the repository root) as commit `commit` holds it; ValueError naming
    both when git cannot show it (no such commit, the file not in it, or no git history here)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{rel}"], capture_output=True, timeout=60)
    except OSError as exc:
        raise ValueError(f"git show {commit}:{rel}: git did not run ({exc})") from exc
    if done.returncode:
        raise ValueError(f"git show {commit}:{rel}: {done.stderr.decode().strip()}")
    return done.stdout


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
    plain = [str(p.relative_to(ROOT)) for p in files if p.suffix == ".jsonl"]
    assert not plain, (f"{plain}: per-request files are committed gzipped (gzip -9n FILE), and only where a "
                       "document quotes them; then scripts/results_manifest.py --write")


def test_removed_artefacts_cited_by_commit_are_in_their_manifest():
    cited = _history_citations()
    assert cited   # the LinearKV replay records and the superseded replays are cited by commit
    problems = []
    for doc, commit, rel in cited:
        path = ROOT / rel
        try:
            _git_show(commit, rel.rstrip("/"))
        except ValueError as exc:
            problems.append(f"{doc}: {exc}")
            continue
        if rel.endswith("/") or path.is_file() or not path.parent.is_dir():
            continue   # a folder, an earlier version of an artefact still in the tree, or a run that left it whole
        removed = manifest.read(path.parent).get("removed", [])
        if not any(commit.startswith(h["commit"][:len(commit)]) and path.name in h["files"] for h in removed):
            problems.append(f"{doc}: git show {commit}:{rel} is not recorded as removed in its manifest")
    assert not problems, "\n".join(problems)


def test_linearkv_reference_records_read_from_the_committed_gzip():
    records = load_records(ROOT / "docs" / "results" / "linearkv" / "results.jsonl.gz")
    assert len(records) > 100 and all(r["key"] == k for k, r in records.items())


# --- every number in a results table is a value of the file it cites ----------------------------
# Convention (README.md, docs/*.md): a results table sits right under a comment naming its sources,
#     <!-- results: docs/results/RUN/report.json [more files] [; from per-request files: COLUMN, ...] -->
# (paths from the repository root; JSON, per-request .jsonl.gz, or the .md table a run wrote). A
# table of superseded runs that left the tree says so and cites each of them by the commit that
# holds it,
#     <!-- results: historical, git COMMIT:docs/results/RUN/report.json [docs/results/KEPT/report.json] -->
# and its numbers are checked against `git show COMMIT:PATH` (a commit-held source in a table not
# marked historical fails, as does a historical table without one). Every
# number in the table's body, outside its first column (the row's name) and outside `code`, must be
# a value of those files at the precision it is printed with: as stored, as a percentage of a
# fraction (x 100), in ms of a value in s (x 1000), per request (a count divided by the run's
# `requests`) or as a share of a list (a worker's part of the prompt tokens). Columns named after
# "; from per-request files:" hold counts that a command printed beside the table (or in the
# section the text names) computes from the committed per-request files (outputs equal to another
# run's, requests reusing more than another server), those after "; derived:" ratios of two cited
# values (a run against
# another), and those after "; settings:" the set-up a row ran with, not a measurement; all are
# exempt and must exist in the header (a clause may name a row instead: its first cell). `<X` is a
# bound: some value below X matches. A table whose
# body holds a measured number (a decimal, a percentage, a ratio) without such a comment fails;
# `<!-- not results: why -->` marks a table of settings or formulas instead.

_EXEMPT = ("from per-request files", "derived", "settings")
_COMMENT = re.compile(r"<!--\s*(results|not results):(.*?)-->", re.S)
_NUMBER = re.compile(r"(?<![\w.\-/^<])(<\s?)?(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?(?:e-?\d+)?)(?=(?:x|s|ms|%)?(?![\w.]))")
_MEASURED = re.compile(r"\d\.\d|\d\s?%|\d(?:\.\d+)?x\b")


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _tables(doc: Path) -> list[tuple[int, str | None, list[str]]]:
    """(line of the header, the comment right above it or None, the table's rows)."""
    lines = doc.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|\s*$", lines[i + 1]):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            above = None
            if k >= 0 and lines[k].rstrip().endswith("-->"):
                start = k
                while start > 0 and "<!--" not in lines[start]:
                    start -= 1
                above = "\n".join(lines[start:k + 1])
            out.append((i + 1, above, lines[i:j]))
            i = j
        else:
            i += 1
    return out


def _numbers(text: str) -> list[tuple[float, float]]:
    """(value, half a unit of its last printed digit) of each number in a cell; a bound written
    `<X` comes back as (X, -1): any value in [0, X) matches it."""
    text = re.sub(r"`[^`]*`", " ", text).replace("**", "")
    out = []
    for m in _NUMBER.finditer(text):
        raw = m.group(2).replace(",", "")
        mant, _, exp = raw.partition("e")
        decimals = len(mant.partition(".")[2])
        out.append((float(raw), -1.0 if m.group(1) else 0.5 * 10 ** (-decimals) * (10 ** int(exp) if exp else 1)))
    return out


def _pool(name: str, raw: bytes) -> list[float]:
    """The values a table citing the file `name` (its content `raw`) may print."""
    if name.endswith(".jsonl.gz"):
        data = [json.loads(x) for x in gzip.decompress(raw).decode().splitlines() if x.strip()]
    elif name.endswith(".json"):
        data = json.loads(raw)
    else:   # a table the run wrote
        return [v for v, _ in _numbers(raw.decode())]
    out: list[float] = []

    def walk(x):
        if isinstance(x, dict):
            n = x.get("requests")
            for v in x.values():
                walk(v)
                if isinstance(n, int) and n > 0 and isinstance(v, (int, float)) and not isinstance(v, bool):
                    out.append(v / n)
        elif isinstance(x, list):
            for v in x:
                walk(v)
            nums = [v for v in x if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if nums and sum(nums) > 0:
                out.extend(v / sum(nums) for v in nums)   # each worker's share
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            out.append(float(x))
    walk(data)
    return out


def _matches(value: float, half: float, pool: list[float]) -> bool:
    if half < 0:
        return any(0 <= v * scale < value for v in pool for scale in (1, 100, 1000))
    tol = half * (1 + 1e-9) + 1e-12
    return any(abs(v * scale - value) <= tol for v in pool for scale in (1, 100, 1000))


def _results_tables():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *NOTES]:
        for line, comment, rows in _tables(doc):
            yield f"{doc.relative_to(ROOT)}:{line}", comment, rows


def _table_problems(where: str, comment: str | None, rows: list[str]) -> list[str]:
    kind, body = _COMMENT.search(comment).groups() if comment and _COMMENT.search(comment) else (None, "")
    header, body_rows = _cells(rows[0]), [_cells(r) for r in rows[2:]]
    if kind is None:
        measured = any(_MEASURED.search(re.sub(r"`[^`]*`", "", c)) for r in body_rows for c in r[1:])
        return [f"{where}: a table of measured numbers without a <!-- results: FILE --> comment"] if measured else []
    if kind == "not results":
        return []
    files_part, *clauses = body.split(";")
    historical = files_part.strip().startswith("historical,")
    files = [f for f in files_part.strip().removeprefix("historical,").split() if f != "git"]
    held = {f: m.groups() for f in files if (m := re.fullmatch(r"([0-9a-f]{7,40}):(docs/results/\S+)", f))}
    if held and not historical:
        return [f"{where}: cites {sorted(held)} by commit, in a table not marked `results: historical,`"]
    if historical and not held:
        return [f"{where}: a historical table cites its superseded runs by commit (git COMMIT:PATH)"]
    exempt = []
    for clause in clauses:
        label, _, names = clause.partition(":")
        if label.strip() not in _EXEMPT:
            return [f"{where}: unknown clause {label.strip()!r} in the results comment (one of {_EXEMPT})"]
        exempt += [c.strip() for c in names.split(",") if c.strip()]
    sources: dict[str, bytes] = {}
    problems = []
    for f in files:
        try:
            sources[f] = _git_show(*held[f]) if f in held else (ROOT / f).read_bytes()
        except (ValueError, OSError):
            problems.append(f"{where}: cites {f}, which is not a file" + (" that commit holds" if f in held else ""))
    if not files or problems:
        return problems or [f"{where}: the results comment names no file"]
    names = [r[0].replace("**", "") for r in body_rows]
    missing = [c for c in exempt if not any(h.startswith(c) for h in [*header, *names])]
    if missing:
        return [f"{where}: exempt column(s) or row(s) {missing} in neither the header {header} nor the rows"]
    pool = [v for f in files for v in _pool(f, sources[f])]
    for r in body_rows:
        if any(r[0].replace("**", "").startswith(c) for c in exempt):
            continue
        for col, cell in enumerate(r[1:], start=1):
            name = header[col] if col < len(header) else f"column {col + 1}"
            if any(name.startswith(c) for c in exempt):
                continue
            for value, half in _numbers(cell):
                if not _matches(value, half, pool):
                    problems.append(f"{where}: row {r[0]!r}, column {name!r}: {value:g} is in none of {files}")
    return problems


def test_results_tables_are_found():
    tables = [t for t in _results_tables() if t[1] and "results:" in t[1] and "not results" not in t[1]]
    assert len(tables) >= 30


@pytest.mark.parametrize("where,comment,rows", [pytest.param(*t, id=t[0]) for t in _results_tables()])
def test_every_number_in_a_results_table_is_in_its_file(where, comment, rows):
    problems = _table_problems(where, comment, rows)
    assert not problems, "\n".join(problems)


def test_a_number_that_drifted_from_its_file_is_named(tmp_path):
    run = "docs/results/replay-kv48-heldout-kv-past-state/report.json"   # stock 80.3 %, Tail-Replay 83.6 %
    doc = tmp_path / "doc.md"
    doc.write_text(f"text\n\n<!-- results: {run} -->\n| server | reused, of ideal | TTFT p50 s |\n|---|---:|---:|\n"
                   "| stock | 80.3 % | 0.072 |\n| Tail-Replay | 83.7 % | 0.066 |\n\n| a | b |\n|---|---|\n| x | 1.5 % |\n")
    (line, comment, rows), (line2, comment2, rows2) = _tables(doc)
    assert _table_problems(f"doc.md:{line}", comment, rows) == [
        f"doc.md:4: row 'Tail-Replay', column 'reused, of ideal': 83.7 is in none of ['{run}']"]
    assert _table_problems(f"doc.md:{line2}", comment2, rows2) == [
        "doc.md:9: a table of measured numbers without a <!-- results: FILE --> comment"]
    exempt = comment.replace(" -->", "; from per-request files: reused -->")
    assert _table_problems("doc.md:4", exempt, rows) == []
    assert _table_problems("doc.md:4", comment.replace(" -->", "; derived: nothing -->"), rows) == [
        "doc.md:4: exempt column(s) or row(s) ['nothing'] in neither the header "
        "['server', 'reused, of ideal', 'TTFT p50 s'] nor the rows"]
    assert _numbers("<0.0001 / **0.0057** (`w4-c8`) 316,928 8.2x") == [
        (0.0001, -1.0), (0.0057, pytest.approx(5e-5)), (316928.0, 0.5), (8.2, pytest.approx(0.05))]


def test_a_historical_table_is_checked_against_the_commit_that_holds_its_run(tmp_path):
    # replay-kv48-heldout-eb left the tree after 286d3cf (stock 80.3 %, Tail-Replay 94.1 % of ideal)
    held = "286d3cf:docs/results/replay-kv48-heldout-eb/report.json"
    rows = ["| server | reused, of ideal |", "|---|---:|", "| stock | 80.3 % |", "| Tail-Replay | 94.1 % |"]
    assert _table_problems("doc.md:4", f"<!-- results: historical, git {held} -->", rows) == []
    drifted = [*rows[:3], "| Tail-Replay | 94.2 % |"]
    assert _table_problems("doc.md:4", f"<!-- results: historical, git {held} -->", drifted) == [
        f"doc.md:4: row 'Tail-Replay', column 'reused, of ideal': 94.2 is in none of ['{held}']"]
    assert _table_problems("doc.md:4", f"<!-- results: git {held} -->", rows) == [
        f"doc.md:4: cites ['{held}'] by commit, in a table not marked `results: historical,`"]
    assert _table_problems("doc.md:4", "<!-- results: historical, docs/results/replay-kv48-default/report.json -->",
                           rows) == ["doc.md:4: a historical table cites its superseded runs by commit (git COMMIT:PATH)"]
    missing = "286d3cf:docs/results/no-such-run/report.json"
    assert _table_problems("doc.md:4", f"<!-- results: historical, git {missing} -->", rows) == [
        f"doc.md:4: cites {missing}, which is not a file that commit holds"]
    with pytest.raises(ValueError, match="git show 286d3cf:docs/results/no-such-run/report.json"):
        _git_show("286d3cf", "docs/results/no-such-run/report.json")


#: a document under docs/ is a reference for the reader who uses or changes the thing: under this
#: many lines; experiment logs live beside their results (`docs/results/RUN/NOTES.md`)
DOC_MAX_LINES = 600


def test_every_document_is_a_reference_of_bounded_length_and_is_indexed():
    docs = sorted((ROOT / "docs").glob("*.md"))
    long = {d.name: n for d in docs if (n := len(d.read_text().splitlines())) >= DOC_MAX_LINES}
    assert not long, f"documents of {DOC_MAX_LINES}+ lines (move experiment logs to docs/results/RUN/NOTES.md): {long}"
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [d.name for d in docs if d.name != "README.md" and f"]({d.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"
