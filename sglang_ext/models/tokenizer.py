"""A small byte-level BPE tokenizer trained locally, with a chat template.

Byte-level BPE encodes any text, so the tiny fixture models accept arbitrary prompts.
Training is deterministic for a fixed corpus and vocabulary size.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

EOS_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [
    EOS_TOKEN, IM_START, IM_END, "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
]

# Qwen-style ChatML with system / user / assistant / tool roles and think markers.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n'"
    " + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


def train_tokenizer(vocab_size: int = 512, corpus_path: Path = CORPUS_PATH) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus_path)], trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json; return the special token ids."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
