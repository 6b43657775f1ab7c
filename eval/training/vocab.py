"""The trained models' tokenizer: byte-level BPE fitted on the training corpus, digits split.

Every digit is its own token (as in Llama / Qwen tokenizers), so copying a 7-digit number is
seven copy steps rather than arbitrary BPE merges. Special tokens and the chat template are
the fixture tokenizer's (`eval.fixtures.tokenizer`).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from eval.corpus import tokenizer_corpus
from eval.fixtures.tokenizer import EOS_TOKEN, SPECIAL_TOKENS, save_tokenizer

VOCAB_SIZE = 2048


def train_vocab(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(tokenizer_corpus(), trainer)
    return tokenizer


def write_vocab(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json in `out_dir`; the special token ids.

    End of text is the raw-completion stop token: generation configs name it as EOS."""
    special = save_tokenizer(tokenizer, out_dir, model_max_length)
    import json

    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = EOS_TOKEN
    config_path.write_text(json.dumps(config, indent=2))
    return special
