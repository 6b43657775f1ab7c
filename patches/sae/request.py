"""Check SAE's request fields when a request arrives: a malformed or out-of-range
`sampling_params.custom_params.token_types` span, or a bad `custom_params.session`, is that
request's HTTP 400 naming the field; the server keeps serving.

Target (SGLang 0.5.23): `srt/managers/tokenizer_manager.py: TokenizerManager.
_validate_one_request(obj, input_ids)`, called per request (per item of a batch) with the
tokenized prompt, so span ends are checked against the prompt's length; SGLang answers a
ValueError raised there with 400. Only on servers running `--radix-eviction-policy sae`.
"""

from __future__ import annotations

import functools

TARGET = "srt/managers/tokenizer_manager.py: TokenizerManager._validate_one_request"


def _sae_in_force() -> bool:
    from sglang.srt.runtime_context import get_server_args

    from sglang_ext.eviction.sglang_adapter import POLICY_NAME

    return getattr(get_server_args(), "radix_eviction_policy", None) == POLICY_NAME


def _wrap(original):
    @functools.wraps(original)
    def _validate_one_request(self, obj, input_ids):
        params = getattr(obj, "sampling_params", None)
        if isinstance(params, dict) and params.get("custom_params") is not None and _sae_in_force():
            from sglang_ext.eviction.serving import parse_request

            parse_request(params["custom_params"], len(input_ids) if input_ids is not None else None)
        return original(self, obj, input_ids)

    return _validate_one_request


def apply() -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    TokenizerManager._validate_one_request = _wrap(TokenizerManager._validate_one_request)
