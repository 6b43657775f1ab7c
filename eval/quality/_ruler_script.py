"""Run one of RULER's generator scripts (shipped in `nvidia-long-context-eval`) in this process.

    python -m eval.quality._ruler_script SCRIPT [script args...]

The scripts split essays with nltk's punkt, whose data cannot be downloaded offline: when it is
missing, `nltk.tokenize.sent_tokenize` is replaced by the project's regex splitter before the
script imports it. The scripts import their siblings by bare name, so their folders go on sys.path.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def _patch_sentence_splitter() -> None:
    import nltk
    import nltk.tokenize

    try:
        nltk.data.find("tokenizers/punkt_tab")
    except LookupError:
        from eval.corpus import split_sentences

        nltk.tokenize.sent_tokenize = lambda text, language="english": split_sentences(text)


def main() -> None:
    script = Path(sys.argv[1])
    sys.argv = [str(script), *sys.argv[2:]]
    _patch_sentence_splitter()
    sys.path[:0] = [str(script.parent), str(script.parent.parent)]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
