"""What the command-line tools say while numba compiles: a first run on a machine waits for the kernels its model
uses to compile with nothing on the screen, so :func:`.cli_support.run_guarded` asks to be told when numba starts
compiling (:func:`on_compiling`) and says what and why on stderr.  numba sends its ``numba:compile`` event for a
compile, not for a load from its on-disk cache, so a warm start says nothing.

Every kernel is cached on disk (``cache=True``), so it compiles once per machine and version; yet a newcomer saw
the note again after ``qwen-demo``, once per command that reached kernels the demo had not used: a kernel compiles
when a weight that calls it is built, and the demo's Q8_0/F16/F32 models build only theirs.  ``--activations q8``
then compiles the 8-bit-activation kernels, a K-quant model the K-quant kernels, a K-quant conversion the
quantizers' searches, each a wait of its own.  So the note names the group of kernels compiling (:data:`GROUPS`),
one line per group as each starts: the line says what the wait is for, and a wait of several groups shows
progress.  (In a checkout whose sources change,
a kernel also compiles again after an edit of a module it imports: its cache stamp covers them, see
:mod:`.jit_setup`.)

A module of its own, imported by no compiled kernel's module: the kernels' cache stamps cover every module they
import (:mod:`.jit_setup`), and this one does not change what they compute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# The compiled functions' modules (prefixes, the first that matches) and what the note calls their kernels.
GROUPS = (
    ("qwen_runtime.backend.kernels.int8", "the 8-bit-activation kernels"),
    ("qwen_runtime.backend.kernels.q8_act", "the 8-bit-activation kernels"),
    ("qwen_runtime.backend.kernels.kquants", "the K-quant (Q2_K..Q6_K) kernels"),
    ("qwen_runtime.backend.kernels.legacy", "the Q4_0/Q4_1/Q5_0/Q5_1 kernels"),
    ("qwen_runtime.backend.kernels.iq4", "the IQ4_NL/IQ4_XS kernels"),
    ("qwen_runtime.backend.kernels.q8_0", "the Q8_0 kernels"),
    ("qwen_runtime.backend.kernels.dense", "the F32/F16 kernels"),
    ("qwen_runtime.quants", "the kernels' shared helpers"),
    ("qwen_runtime.models", "the compiled decode step"),
    ("qwen_runtime", "the runtime's compiled operations"),
    ("qwen_convert", "the quantizers' rounding searches"),
)
INTERNAL = "numba."  # numba's own helpers, compiled inside a compile of ours: no group of their own
OTHER = "kernels"

_LOCK = threading.Lock()
_listening = False  # numba's compile events reach _compile_started
_hook: Callable[[str], None] | None = None  # on_compiling's
_told: set[str] = set()  # the groups the hook was called for


def describe(module: str) -> str:
    """What the note calls the kernels of ``module`` (:data:`GROUPS`; :data:`OTHER` for any other module)."""
    return next((what for prefix, what in GROUPS if module == prefix or module.startswith(prefix + ".")
                 or module.startswith(prefix + "_")), OTHER)


def on_compiling(hook: Callable[[str], None] | None) -> None:
    """Call ``hook(what)`` when numba starts compiling a function (after :func:`listen`), once per group of
    kernels (:func:`describe`) until the hook is replaced; None forgets the hook.  Imports nothing."""
    global _hook
    with _LOCK:
        _hook = hook
        _told.clear()


def listen() -> None:
    """Install numba's listener of its ``numba:compile`` event, once per process (imports numba: call it where
    numba is used anyway, as the runtime does when it resolves its kernels to the compiled ones)."""
    global _listening
    with _LOCK:
        if _listening:
            return
        from numba.core import event

        class Compiling(event.Listener):
            def on_start(self, ev: event.Event) -> None:
                function = getattr(ev.data.get("dispatcher"), "py_func", None)
                _compile_started(getattr(function, "__module__", None) or "")

            def on_end(self, ev: event.Event) -> None:
                pass

        event.register("numba:compile", Compiling())
        _listening = True


def _compile_started(module: str) -> None:
    if module.startswith(INTERNAL):
        return
    what = describe(module)
    with _LOCK:
        hook = _hook if what not in _told else None
        _told.add(what)
    if hook is not None:
        hook(what)
