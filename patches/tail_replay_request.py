"""Validate a request's Tail-Replay overrides when it arrives, so a bad one is that request's HTTP
400 naming the key, never a scheduler crash.

Target (SGLang 0.5.23): `srt/sampling/sampling_params.py::SamplingParams.verify`
(`custom_params["tail_replay"]`).
"""

from __future__ import annotations

import functools

TARGET = "srt/sampling/sampling_params.py: SamplingParams.verify"


def _wrap_verify(original):
    @functools.wraps(original)
    def verify(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from sglang_ext.env import read_tail_replay_config
        from sglang_ext.tail_replay.config import REQUEST_PARAM_KEY, with_overrides

        overrides = (self.custom_params or {}).get(REQUEST_PARAM_KEY)
        if overrides is not None:
            with_overrides(read_tail_replay_config(), overrides)

    return verify


def apply() -> None:
    from sglang.srt.sampling.sampling_params import SamplingParams

    SamplingParams.verify = _wrap_verify(SamplingParams.verify)
