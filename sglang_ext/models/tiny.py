"""Build tiny, deterministic, random-weight hybrid checkpoints that SGLang and transformers load.

Each architecture registers a builder: `(seed, layout) -> PreTrainedModel`. `build_tiny_model`
adds the locally trained tokenizer and writes an ordinary HF folder (safetensors, fp32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from sglang_ext.models.tokenizer import EOS_TOKEN, IM_END, save_tokenizer, train_tokenizer

VOCAB_SIZE = 512
MAX_POSITIONS = 65536


@dataclass(frozen=True)
class TokenIds:
    eos: int
    pad: int


#: (seed, layout, token ids) -> (model, extra config.json fields SGLang reads but transformers omits)
ModelBuilder = Callable[[int, str, TokenIds], "tuple[torch.nn.Module, dict]"]
ARCH_BUILDERS: dict[str, ModelBuilder] = {}
ARCH_LAYOUTS: dict[str, tuple[str, ...]] = {}


def register_arch(name: str, layouts: tuple[str, ...]) -> Callable[[ModelBuilder], ModelBuilder]:
    def wrap(builder: ModelBuilder) -> ModelBuilder:
        ARCH_BUILDERS[name] = builder
        ARCH_LAYOUTS[name] = layouts
        return builder

    return wrap


def build_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, layout: str | None = None) -> Path:
    """Write a tiny checkpoint of `arch` to `out_dir`; same seed -> same bytes."""
    _load_arch_modules()
    if arch not in ARCH_BUILDERS:
        raise ValueError(f"unknown --arch {arch!r}; choose from {sorted(ARCH_BUILDERS)}")
    layout = layout or ARCH_LAYOUTS[arch][0]
    if layout not in ARCH_LAYOUTS[arch]:
        raise ValueError(f"unknown --layout {layout!r} for {arch}; choose from {ARCH_LAYOUTS[arch]}")
    out = Path(out_dir)
    special = save_tokenizer(train_tokenizer(VOCAB_SIZE), out, MAX_POSITIONS)
    ids = TokenIds(eos=special[IM_END], pad=special[EOS_TOKEN])
    torch.manual_seed(seed)
    model, extra_config = ARCH_BUILDERS[arch](seed, layout, ids)
    model.save_pretrained(out, safe_serialization=True)
    _patch_config_json(out, extra_config)
    _write_generation_config(out, ids)
    return out


def _write_generation_config(out: Path, ids: TokenIds) -> None:
    config = {"eos_token_id": ids.eos, "pad_token_id": ids.pad, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(config, indent=2))


def _patch_config_json(out: Path, fields: dict) -> None:
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config, indent=2))


def _load_arch_modules() -> None:
    from sglang_ext.models import nemotron_h, qwen3_next  # noqa: F401  (registration)
