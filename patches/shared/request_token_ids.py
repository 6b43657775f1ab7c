"""Refuse a request whose `input_ids` leave the vocabulary, instead of crashing the server.

Targets `srt/managers/tokenizer_manager.py::TokenizerManager._validate_one_request` (SGLang
0.5.23), which checks prompt lengths but not token ids: an id >= vocab_size reaches
`F.embedding` in the scheduler and kills it ("IndexError: index out of range in self" on CPU, a
device-side assert on CUDA), taking every running request down. The wrapped check raises
ValueError first, which SGLang answers with HTTP 400 for that request only.
"""

from __future__ import annotations

import functools

TARGET = "srt/managers/tokenizer_manager.py: TokenizerManager._validate_one_request"


def out_of_vocabulary(input_ids, vocab_size: int) -> str | None:
    """The error for the first id outside [0, vocab_size), or None when all are inside.
    Runs per request: min/max (C loops) first, the position only for a bad request."""
    if not input_ids or (min(input_ids) >= 0 and max(input_ids) < vocab_size):
        return None
    for position, token_id in enumerate(input_ids):
        if not 0 <= token_id < vocab_size:
            return (f"input_ids[{position}] = {token_id} is not a token id of this model "
                    f"(vocabulary size {vocab_size}; valid ids are 0..{vocab_size - 1})")
    return None


def _wrap(original):
    @functools.wraps(original)
    def _validate_one_request(self, obj, input_ids):
        error = out_of_vocabulary(input_ids, self.model_config.vocab_size)
        if error is not None:
            raise ValueError(error)
        return original(self, obj, input_ids)

    return _validate_one_request


def apply() -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    TokenizerManager._validate_one_request = _wrap(TokenizerManager._validate_one_request)
