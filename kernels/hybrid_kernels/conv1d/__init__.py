"""Causal depthwise conv1d with a rolling input window (pure torch; conventions in `naive.py`)."""

from hybrid_kernels.conv1d.naive import causal_conv1d_ref, roll_window

__all__ = ["causal_conv1d_ref", "roll_window"]
