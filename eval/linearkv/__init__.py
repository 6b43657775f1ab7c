"""LinearKV evaluation (reference path): `python -m eval.linearkv`."""
