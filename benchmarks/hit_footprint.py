"""How many of the extension's modules one plain Tail-Replay hit runs through, in the real server.

Starts one Tail-Replay server (defaults, `--mamba-radix-cache-strategy extra_buffer`, the tiny
Qwen3-Next fixture unless `--model`) whose every Python process loads
`benchmarks/footprint_site/sitecustomize.py`: a profile hook notes the file of each function
called, per phase. After a warm-up of the same request pattern (so that lazy imports and first
uses are not counted), it measures, one request at a time, greedy, one output token:

  idle    nothing sent, as long as the longest request phase (what the server's loops run anyway)
  exact   a document of D tokens sent alone, then the document + q new tokens: an exact hit
          (`exact_checkpoint`) that resumes from the document's state
  approx  a second document sent with q tokens after it, then the same document with another q
          tokens: the first request's state sits below where the two part, so no exact state is on
          the matched path (stock SGLang misses here) and the default replays (`approximate`); the
          shared-state repair it asks for runs inside the phase too

A module counts for a phase when any function of it ran in any of the server's processes
(tokenizer manager, scheduler, detokenizer) while the phase was open. The report lists, per
phase, the modules of the Tail-Replay wing (`sglang_ext/tail_replay/`, subpackages included)
and of `patches/`, and the share of the wing's modules each phase touched.

    .venv/bin/python benchmarks/hit_footprint.py --out runs/hit-footprint
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.fixtures.tiny import build_tiny_model  # noqa: E402
from eval.harness import ServerProcess  # noqa: E402

SITE = ROOT / "benchmarks" / "footprint_site"
WING = "sglang_ext/tail_replay/"
PHASES = ("idle", "exact", "approx")
SETTLE_S = 0.5   # every process's watcher reads the phase file every 20 ms
REPAIR_S = 1.5   # time left to a background run a request asked for


def wing_modules() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / WING).rglob("*.py"))


def post(server: ServerProcess, ids: list[int]) -> dict:
    response = requests.post(f"{server.url}/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    response.raise_for_status()
    return response.json()["meta_info"]


def kind_of(meta: dict) -> str:
    return meta["cached_tokens_details"]["tail_replay"]["kind"]


def pattern(rng: random.Random, d: int, q: int) -> dict[str, list[int]]:
    """One round's prompts on fresh tokens: a document and its exact hit; a second document's first
    request and the request that branches off it (the approximate hit)."""
    tok = lambda n: [rng.randrange(10, 500) for _ in range(n)]   # noqa: E731
    doc, other = tok(d), tok(d)
    return {"doc": doc, "exact": doc + tok(q), "first": other + tok(q), "approx": other + tok(q)}


def send_round(server: ServerProcess, prompts: dict[str, list[int]], phase=None) -> dict[str, tuple[str, float]]:
    """Send a round; `phase(name)` opens each measured request's phase (warm-up: None). Returns
    each measured request's (answer kind, seconds)."""
    got = {}
    for name in ("doc", "exact", "first", "approx"):
        measured = name in ("exact", "approx")
        if measured and phase is not None:
            phase(name)
        start = time.perf_counter()
        meta = post(server, prompts[name])
        if measured:
            time.sleep(REPAIR_S)   # a background repair the hit asked for runs inside its phase
            got[name] = (kind_of(meta), time.perf_counter() - start)
        if measured and phase is not None:
            phase("between")
    return got


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_tiny_model("qwen3-next", out / "model-qwen3-next", seed=0)
    control = Path(tempfile.mkdtemp(prefix="footprint-", dir=out))
    phase_file = control / "phase"
    server = ServerProcess(str(model), ["--radix-cache-backend", "tail_replay", "--mamba-radix-cache-strategy",
                                       "extra_buffer"], log_path=out / "server.log",
                           env={"PYTHONPATH": f"{SITE}:{ROOT}", "SGLANG_EXT_FOOTPRINT_DIR": str(control)})

    def phase(name: str) -> None:
        phase_file.write_text(name)
        time.sleep(SETTLE_S)

    rng = random.Random(args.seed)
    server.start()
    try:
        phase("warm")
        for _ in range(2):   # the same pattern: first uses and lazy imports happen here
            send_round(server, pattern(rng, args.document, args.q))
        got = send_round(server, pattern(rng, args.document, args.q), phase)
        phase("idle")
        time.sleep(max(seconds for _, seconds in got.values()))
        phase("end")
    finally:
        server.stop()
    kinds = {name: kind for name, (kind, _) in got.items()}
    touched: dict[str, set[str]] = {name: set() for name in PHASES}
    functions: dict[str, set[str]] = {name: set() for name in PHASES}
    processes = 0
    for path in control.glob("*-*.json"):
        pid, name = path.stem.split("-", 1)
        if name in touched:
            noted = json.loads(path.read_text())
            touched[name] |= set(noted["modules"])
            functions[name] |= set(noted.get("functions", ()))
            processes += name == "exact"
    wing = wing_modules()
    rows = {}
    for name in PHASES:
        mods = sorted(touched[name])
        ours = [m for m in mods if m.startswith(WING)]
        rows[name] = {"kind": kinds.get(name), "wing_modules": ours, "wing_touched": len(ours),
                      "wing_total": len(wing), "wing_share": round(len(ours) / len(wing), 3),
                      "patch_modules": [m for m in mods if m.startswith("patches/")],
                      "other_modules": [m for m in mods if not m.startswith((WING, "patches/"))],
                      "wing_functions": sorted(f for f in functions[name] if f.startswith(WING))}
    report = {"command": " ".join(sys.argv), "document": args.document, "q": args.q,
              "processes_reporting": processes, "phases": rows}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# One Tail-Replay hit's footprint (D = {args.document}, q = {args.q})", "",
             f"`{report['command']}`", "",
             "| phase | answer kind | wing modules touched | of the wing's | patch modules touched |",
             "|---|---|---:|---:|---:|"]
    for name in PHASES:
        r = rows[name]
        lines.append(f"| {name} | {r['kind'] or '-'} | {r['wing_touched']} | {r['wing_total']} "
                     f"({100 * r['wing_share']:.0f} %) | {len(r['patch_modules'])} |")
    for name in PHASES:
        lines += ["", f"{name}: " + ", ".join(m.removeprefix(WING) for m in rows[name]["wing_modules"])]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for name, want in (("exact", "exact_checkpoint"), ("approx", "approximate")):
        if kinds.get(name) != want:
            print(f"warning: the {name} request was served as {kinds.get(name)!r}, not {want!r}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--document", type=int, default=500,
                    help="D: the shared document's tokens (off the extra buffer's grid: no state lands at D)")
    ap.add_argument("--q", type=int, default=32, help="new tokens after the document")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="a Qwen3-Next checkpoint folder (default: build the tiny fixture)")
    ap.add_argument("--out", default="runs/hit-footprint")
    sys.exit(run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
