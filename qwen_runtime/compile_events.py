"""What the command-line tools say while numba compiles: a first run on a machine waits for the kernels its model
uses to compile (a Q8_0 model's kernels and decode step: 45 s of CPU on this project's 2-core machine) with
nothing on the screen, so :func:`.cli_support.run_guarded` asks to be told when numba starts compiling
(:func:`on_first_compile`) and says why on stderr.  numba sends its ``numba:compile`` event for a compile, not for a
load from its on-disk cache, so a warm start says nothing.

A module of its own, imported by no compiled kernel's module: the kernels' cache stamps cover every module they
import (:mod:`.jit_setup`), and this one does not change what they compute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_LOCK = threading.Lock()
_listening = False  # numba's compile events reach _first_compile_started
_hook: Callable[[], None] | None = None  # on_first_compile's


def on_first_compile(hook: Callable[[], None] | None) -> None:
    """Call ``hook`` once, the next time numba compiles a function (after :func:`listen`), then forget it; None
    forgets the hook.  Imports nothing."""
    global _hook
    _hook = hook


def listen() -> None:
    """Install numba's listener of its ``numba:compile`` event, once per process (imports numba: call it where
    numba is used anyway, as the runtime does when it resolves its kernels to the compiled ones)."""
    global _listening
    with _LOCK:
        if _listening:
            return
        from numba.core import event

        class FirstCompile(event.Listener):
            def on_start(self, ev: event.Event) -> None:  # noqa: ARG002
                _first_compile_started()

            def on_end(self, ev: event.Event) -> None:
                pass

        event.register("numba:compile", FirstCompile())
        _listening = True


def _first_compile_started() -> None:
    global _hook
    hook, _hook = _hook, None
    if hook is not None:
        hook()
