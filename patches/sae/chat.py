"""Token types of chat-completion requests from their message roles.

Target (SGLang 0.5.23): `srt/entrypoints/openai/serving_chat.py: OpenAIServingChat.
_convert_to_internal_request`, which renders the messages with the chat template into prompt
ids and builds the GenerateReqInput. On a server running `--radix-eviction-policy sae`, when
the request carries no `token_types` of its own, the spans of each message (as the template
renders it, markers included; reasoning inside assistant turns between the template's think
markers) are put into `sampling_params.custom_params.token_types`, the same field a
`/generate` client sends (`sglang_ext.eviction.serving.chat_spans`). A template that cannot
render a message prefix leaves the request untyped (logged once); the request is served.
"""

from __future__ import annotations

import functools
import logging

TARGET = "srt/entrypoints/openai/serving_chat.py: OpenAIServingChat._convert_to_internal_request"
logger = logging.getLogger(__name__)
_warned = []


def _ids(rendered):
    if isinstance(rendered, dict) or hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    return list(rendered)


def _think_ids(tokenizer):
    try:
        ids = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    except Exception:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    if any(i is None or i == unk for i in ids):
        return None
    return ids[0], ids[1]


def request_spans(tokenizer, request, prompt_ids):
    """Spans of ``prompt_ids`` by the roles of ``request.messages`` (see module doc)."""
    from sglang_ext.eviction.serving import chat_spans

    messages = [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
                for m in request.messages]
    kwargs = dict(request.chat_template_kwargs or {})
    tools = getattr(request, "tools", None)
    if tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else t for t in tools]

    def render(k):
        return _ids(tokenizer.apply_chat_template(messages[:k], tokenize=True, add_generation_prompt=False,
                                                  **kwargs))

    return chat_spans(prompt_ids, [m.get("role", "") for m in messages], render, _think_ids(tokenizer))


def _wrap(original):
    @functools.wraps(original)
    def _convert_to_internal_request(self, request, raw_request=None):
        adapted, request_out = original(self, request, raw_request)
        from sglang_ext.patches.sae.request import _sae_in_force

        params = adapted.sampling_params
        if not (_sae_in_force() and isinstance(adapted.input_ids, list) and adapted.input_ids
                and isinstance(adapted.input_ids[0], int) and isinstance(params, dict)):
            return adapted, request_out
        from sglang_ext.eviction.serving import TYPES_FIELD, spans_to_field

        custom = params.get("custom_params") or {}
        if isinstance(custom, dict) and TYPES_FIELD not in custom:
            try:
                spans = request_spans(self.tokenizer_manager.tokenizer, request, adapted.input_ids)
            except Exception as exc:  # a template that cannot render prefixes: serve untyped
                if not _warned:
                    _warned.append(True)
                    logger.warning("sae: chat messages left untyped (%s: %s)", type(exc).__name__, exc)
                return adapted, request_out
            params["custom_params"] = {**custom, TYPES_FIELD: spans_to_field(spans)}
        return adapted, request_out

    return _convert_to_internal_request


def apply() -> None:
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    OpenAIServingChat._convert_to_internal_request = _wrap(OpenAIServingChat._convert_to_internal_request)
