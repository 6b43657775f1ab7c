"""`python -m sglang_ext serve | tiny-model | demo` (also the `sglang-ext` console script)."""

from sglang_ext.cli import main

if __name__ == "__main__":
    main()
