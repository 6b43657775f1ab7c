"""Manifests of the committed results (docs/results/): one MANIFEST.json per run folder (every
folder that holds files), listing each artefact beside it with its size and sha256, and the
artefacts a run once had that left the tree (superseded per-request files and plots), with the
commit that still holds them (`git show COMMIT:docs/results/RUN/FILE`).

    .venv/bin/python scripts/results_manifest.py            # check every manifest (exit 1 on a mismatch)
    .venv/bin/python scripts/results_manifest.py --write    # (re)write them after adding or changing a run

tests/test_results_files.py runs the check. Per-request files (`*.jsonl`) are committed gzipped
(`*.jsonl.gz`, read with Python's gzip) and only for the runs the docs quote by per-request file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
NAME = "MANIFEST.json"


def run_folders(results: Path = RESULTS) -> list[Path]:
    """Every folder under `results` that holds at least one file besides its manifest."""
    return sorted(d for d in [results, *results.rglob("*")]
                  if d.is_dir() and any(p.is_file() and p.name != NAME for p in d.iterdir()))


def artefacts(folder: Path) -> dict[str, dict]:
    """Size and sha256 of each file directly in `folder` (the manifest itself left out)."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != NAME}


def read(folder: Path) -> dict:
    """The folder's manifest; ValueError naming the file when it is missing or malformed."""
    path = folder / NAME
    if not path.is_file():
        raise ValueError(f"{path.relative_to(ROOT)}: no manifest (run scripts/results_manifest.py --write)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.relative_to(ROOT)}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise ValueError(f"{path.relative_to(ROOT)}: no 'files' object")
    return data


def write(folder: Path, removed: list[str] | None = None, commit: str | None = None) -> None:
    """(Re)write `folder`'s manifest from the files in it. `removed` (with `commit`, the commit that
    holds them) adds to the artefacts already recorded as removed; those recorded before are kept."""
    old = read(folder) if (folder / NAME).is_file() else {}
    history = list(old.get("removed", []))
    if removed:
        if not commit:
            raise ValueError("removed artefacts need the commit that holds them")
        history.append({"commit": commit, "files": sorted(removed)})
    data: dict = {"files": artefacts(folder)}
    if history:
        data["removed"] = history
    (folder / NAME).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def problems(folder: Path) -> list[str]:
    """How `folder`'s files differ from its manifest (empty when they agree)."""
    rel = folder.relative_to(ROOT)
    try:
        listed = read(folder)["files"]
    except ValueError as exc:
        return [str(exc)]
    found = artefacts(folder)
    out = [f"{rel}/{n}: in the folder, not in {NAME}" for n in sorted(found.keys() - listed.keys())]
    out += [f"{rel}/{n}: in {NAME}, not in the folder" for n in sorted(listed.keys() - found.keys())]
    for n in sorted(found.keys() & listed.keys()):
        for key in ("bytes", "sha256"):
            if listed[n].get(key) != found[n][key]:
                out.append(f"{rel}/{n}: {key} {found[n][key]} on disk, {listed[n].get(key)} in {NAME}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="(re)write every manifest from the files on disk")
    p.add_argument("folders", nargs="*", type=Path, help="run folders (default: all under docs/results)")
    args = p.parse_args(argv)
    folders = [f.resolve() for f in args.folders] or run_folders()
    if args.write:
        for f in folders:
            write(f)
        return 0
    bad = [msg for f in folders for msg in problems(f)]
    print("\n".join(bad) if bad else f"{len(folders)} manifests agree with their folders")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
