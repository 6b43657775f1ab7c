"""The one sample type every benchmark source produces."""

from __future__ import annotations

from dataclasses import dataclass

#: what the warm-up request asks after the shared document (any question other than the real one)
WARM_QUESTION = "\n\nQuestion: What is the first sentence of the text above?\nAnswer:"


@dataclass(frozen=True)
class EvalSample:
    benchmark: str            # "ruler" | "longbench"
    dataset: str              # RULER task or LongBench dataset
    sample_id: str
    prompt: str
    shared_chars: int         # prompt[:shared_chars] is the document shared with the warm-up
    answers: tuple[str, ...]
    max_new_tokens: int
    length: int               # prompt length in tokens as the source measured it
    all_classes: tuple[str, ...] | None = None
    group: str = ""           # length group reported separately ("4K", LongBench-E "0-4k", ...)

    @property
    def key(self) -> str:
        return f"{self.benchmark}/{self.dataset}/{self.sample_id}"

    def warm_prompt(self) -> str:
        return self.prompt[: self.shared_chars] + WARM_QUESTION


def cut_before_last(prompt: str, marker: str) -> int:
    """Index where the last `marker` starts (the question after the document); ValueError if absent."""
    index = prompt.rfind(marker)
    if index <= 0:
        raise ValueError(f"question marker {marker!r} not found in the prompt")
    return index
