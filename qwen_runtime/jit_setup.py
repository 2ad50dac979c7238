"""numba's start-up without the part our kernels do not use: the SciPy import of its BLAS probe.

The first kernel a process compiles or loads from numba's cache makes numba set up its CPU target, which
imports ``numba.np.arraymath``; at import that module probes for BLAS with ``import scipy.linalg.cython_blas``,
which imports all of ``scipy.linalg`` (with SciPy installed, measured: 0.12 s of CPU time, over a quarter of
numba's warm-cache start-up).  The probe only chooses, for ``np.correlate``/``np.convolve`` in compiled code,
between ``np.dot`` and a plain loop; none of our kernels calls them, nor any BLAS from compiled code.

:func:`prepare_numba` runs that set-up (numba's own, in its own order, only earlier) with
``scipy.linalg.cython_blas`` unimportable for the duration, then sets the probe's result to what it would have
been (SciPy present), so other compiled code in the process behaves as with numba alone (numba's BLAS and LAPACK
functions import SciPy themselves when first compiled).
"""

from __future__ import annotations

import sys
import threading

_PROBED = "scipy.linalg.cython_blas"  # what numba.np.arraymath imports to probe for BLAS
_LOCK = threading.Lock()  # models loaded in two threads at once set numba up once


def prepare_numba() -> None:
    """Set up numba's CPU target without its SciPy import, once per process, before the first compile."""
    with _LOCK:
        if "numba.np.arraymath" in sys.modules or _PROBED in sys.modules:
            return  # set up already, or SciPy's BLAS bindings imported anyway: nothing to save
        from numba.core.registry import cpu_target  # imports SciPy's top-level package when installed (cheap)

        sys.modules[_PROBED] = None  # makes `import scipy.linalg.cython_blas` fail at once, before scipy.linalg
        try:
            cpu_target.target_context.refresh()  # what the first compile or cache load does
        finally:
            del sys.modules[_PROBED]
        from numba.np import arraymath

        arraymath._HAVE_BLAS = "scipy" in sys.modules
