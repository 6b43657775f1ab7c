"""`--profile`: py-spy samples each server's scheduler during its replay; where its time goes.

The scheduler runs the whole request path outside the HTTP front end: the tree match, the plan,
scheduling, the forward, the insert and eviction. A sample is one stack of its main thread (py-spy
records active stacks only: a scheduler waiting for work is not sampled). Per server, the summary
splits the sampled time per request into the model forward (`forward_batch_generation`; its
extend and decode batches apart) and the rest, and names the functions that take the rest (their
inclusive time in samples outside the forward), with the share spent in this repository's code
(frames under `sglang_ext/`, inside the forward too). Two servers replaying the same requests can then be compared function by function
(`profile_differences`). py-spy itself takes CPU: timings of a profiled replay are not comparable
with an unprofiled one's, only with another profiled server's of the same run.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

#: a frame of the model forward
FORWARD = re.compile(r"forward_batch_generation \(")
#: the forward of a decode batch (SGLang's eager runner; on a GPU the CUDA graph replays it) / of an extend
DECODE = re.compile(r"_execute_decode \(|CudaGraphRunner\.replay \(")
EXTEND = re.compile(r"_execute_extend \(")
#: a frame of this repository's code
OURS = re.compile(r"(?:^|[/(])(?:sglang_ext|patches)/")
#: py-spy samples per second
RATE = 250


class ProfileError(RuntimeError):
    """py-spy could not sample the server (missing, no permission, process not found)."""


def scheduler_pid(root_pid: int) -> int:
    """The scheduler process under a server's process `root_pid`."""
    try:
        procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.Error as err:
        raise ProfileError(f"--profile: server process {root_pid} is gone ({err})") from None
    for proc in procs:
        try:
            text = proc.name() + " " + " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "scheduler" in text:
            return proc.pid
    raise ProfileError(f"--profile: no scheduler process under server process {root_pid}")


def process_cpu_seconds(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system, all threads) so far of a server's processes, by role: `http`
    (the server process: HTTP and tokenizer manager) and each child by its process name
    (`sglang::scheduler`, `sglang::detokenizer`, ...). Processes that are gone are left out."""
    out: dict[str, float] = {}
    try:
        root = psutil.Process(root_pid)
        procs = [(root, "http"), *((c, None) for c in root.children(recursive=True))]
    except psutil.Error:
        return out
    for proc, role in procs:
        try:
            times = proc.cpu_times()
            name = role or proc.name()
        except psutil.Error:
            continue
        out[name] = out.get(name, 0.0) + times.user + times.system
    return out


def cpu_per_request(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
    """ms of CPU per request per process role between two `process_cpu_seconds` readings."""
    return {name: round(1e3 * (after[name] - before.get(name, 0.0)) / max(requests, 1), 3) for name in sorted(after)}


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise ProfileError("--profile needs py-spy (pip install 'sglang-hybrid-cache[eval]')")
    return found


@dataclass
class Sampler:
    """py-spy recording one process's stacks into `raw` (py-spy's raw, collapsed format)."""

    pid: int
    raw: Path
    rate: int = RATE
    proc: subprocess.Popen | None = None

    def start(self) -> Sampler:
        self.proc = subprocess.Popen([py_spy(), "record", "-p", str(self.pid), "-r", str(self.rate), "-f", "raw",
                                      "-o", str(self.raw), "--nonblocking"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)   # py-spy attaches
        if self.proc.poll() is not None:
            raise ProfileError(f"--profile: py-spy exited at once: {self.proc.stderr.read().decode()[-500:]}")
        return self

    def stop(self) -> None:
        """End the recording (py-spy writes the file on SIGINT)."""
        if self.proc is None:
            return
        self.proc.send_signal(2)
        _, err = self.proc.communicate(timeout=120)
        if not self.raw.exists():
            raise ProfileError(f"--profile: py-spy wrote no profile: {err.decode()[-500:]}")


def _function(frame: str) -> str:
    """`name (file.py:123)` -> `name (file.py)`: one name per function, whatever the line."""
    return re.sub(r":\d+\)$", ")", frame)


def summarize_profile(raw: Path, requests: int, rate: int = RATE, top: int = 25) -> dict:
    """Per request, ms of sampled scheduler time: in all, in the forward, outside it, in our code;
    and the functions with the most inclusive time outside the forward (and ours, anywhere)."""
    total = forward = ours = decode = extend = 0
    outside: collections.Counter[str] = collections.Counter()
    mine: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        cut = next((i for i, f in enumerate(frames) if FORWARD.search(f)), None)
        if cut is not None:
            forward += n
            decode += n if any(DECODE.search(f) for f in frames[cut:]) else 0
            extend += n if any(EXTEND.search(f) for f in frames[cut:]) else 0
        else:
            for name in {_function(f) for f in frames}:
                outside[name] += n
        our_frames = {_function(f) for f in frames if OURS.search(f)}
        if our_frames:
            ours += n
            for name in our_frames:
                mine[name] += n
    ms = 1e3 / rate / max(requests, 1)
    return {"requests": requests, "samples": total, "rate_hz": rate,
            "ms_per_request": {"sampled": total * ms, "forward": forward * ms, "outside_forward": (total - forward) * ms,
                               "forward_extend": extend * ms, "forward_decode": decode * ms, "sglang_ext": ours * ms},
            "outside_forward": [[name, round(n * ms, 3)] for name, n in outside.most_common(top)],
            "sglang_ext": [[name, round(n * ms, 3)] for name, n in mine.most_common(top)]}


def profile_differences(profile: dict, baseline: dict, top: int = 15) -> list[list]:
    """Functions outside the forward whose ms per request differ most from the baseline's
    ([name, ms here, ms there, difference]); only functions in either side's top list."""
    here, there = dict(profile["outside_forward"]), dict(baseline["outside_forward"])
    rows = [[name, here.get(name, 0.0), there.get(name, 0.0), round(here.get(name, 0.0) - there.get(name, 0.0), 3)]
            for name in set(here) | set(there)]
    return sorted(rows, key=lambda r: (-abs(r[3]), r[0]))[:top]


def profile_lines(rows: list[dict], baseline: str | None) -> list[str]:
    """report.md: CPU per request of each server's processes; with `--profile`, one line per
    profiled server and the largest differences from the baseline."""
    lines = []
    cpu = {r["server"]: r["process_cpu_ms_per_request"] for r in rows if r.get("process_cpu_ms_per_request")}
    if cpu:
        roles = sorted({role for per in cpu.values() for role in per})
        lines += ["", "CPU per request of each server's processes (ms, user + system, all threads, over its replay):", "",
                  "| server | " + " | ".join(roles) + " |", "|---|" + "---:|" * len(roles)]
        lines += [f"| {name} | " + " | ".join(f"{per.get(role, 0.0):.1f}" for role in roles) + " |"
                  for name, per in cpu.items()]
    profiled = {r["server"]: r["profile"] for r in rows if r.get("profile")}
    if not profiled:
        return lines
    lines += ["", "Scheduler time per request (py-spy, `--profile`; comparable between servers of this run only). "
             "The decode forward does the same work on every server of a one-at-a-time replay (same model, same "
             "context, same output length): a difference there is not the forward's own but what else took the "
             "CPUs while it ran (the server's other processes, the machine).", "",
             "| server | sampled ms | forward: extend / decode ms | outside the forward ms | in sglang_ext ms |",
             "|---|---:|---:|---:|---:|"]
    for name, p in profiled.items():
        m = p["ms_per_request"]
        lines.append(f"| {name} | {m['sampled']:.2f} | {m['forward']:.2f}: {m['forward_extend']:.2f} / "
                     f"{m['forward_decode']:.2f} | {m['outside_forward']:.2f} | {m['sglang_ext']:.2f} |")
    if baseline in profiled:
        for name, p in profiled.items():
            if name == baseline:
                continue
            lines += ["", f"Largest differences outside the forward, {name} against {baseline} (ms per request):", ""]
            lines += [f"- {d:+.3f} `{fn}` ({a:.3f} vs {b:.3f})" for fn, a, b, d in profile_differences(p, profiled[baseline])]
    return lines
