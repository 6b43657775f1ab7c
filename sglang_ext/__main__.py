"""`python -m sglang_ext serve` (also the `sglang-ext` console script)."""

from sglang_ext.cli import main

if __name__ == "__main__":
    main()
