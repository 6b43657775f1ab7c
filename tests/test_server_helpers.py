"""eval.harness helpers that need no server."""

from __future__ import annotations

import os
import signal
import time

import pytest

from eval.harness import sigterm_deferred, sigterm_unwinds


def test_sigterm_unwinds_through_finally_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    stopped = []
    with pytest.raises(SystemExit) as exit_info:
        with sigterm_unwinds():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                stopped.append("servers")
    assert exit_info.value.code == 143 and stopped == ["servers"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_during_cleanup_waits_for_it_then_exits():
    before = signal.getsignal(signal.SIGTERM)
    steps = []
    with pytest.raises(SystemExit) as exit_info:
        with sigterm_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            steps.append("first server stopped")
            steps.append("second server stopped")
    assert exit_info.value.code == 143 and steps == ["first server stopped", "second server stopped"]
    assert signal.getsignal(signal.SIGTERM) is before
