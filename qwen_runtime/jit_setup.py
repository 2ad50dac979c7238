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

It also lets LLVM use 512-bit vectors on CPUs with AVX-512 (:func:`cpu_features`): LLVM's tuning for Intel's
AVX-512 cores ("prefer-256-bit") splits the kernels' loops into 256-bit halves.  One row, one thread, out of
cache, ms of CPU per million weights with/without (the prefetching kernels, two alternating pairs): Q8_0
0.107-0.112 / 0.120-0.124, Q4_K 0.122-0.127 / 0.145-0.146, Q6_K 0.145-0.146 / 0.152-0.155, Q4_0 0.093 /
0.095-0.100, Q5_0 0.127-0.131 / 0.126-0.130.  numba keys its on-disk cache by the features, so cached code never
mixes the two; a user's ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` is left alone.
"""

from __future__ import annotations

import sys
import threading

_PROBED = "scipy.linalg.cython_blas"  # what numba.np.arraymath imports to probe for BLAS
_LOCK = threading.Lock()  # models loaded in two threads at once set numba up once


def cpu_features(host: str) -> str | None:
    """numba's CPU features for the host's LLVM feature string ``host``: with AVX-512, the same without LLVM's
    preference for 256-bit vectors; None (numba's own choice) otherwise."""
    return f"{host},-prefer-256-bit" if "+avx512f" in host.split(",") else None


def prepare_numba() -> None:
    """Set up numba's CPU target without its SciPy import, once per process, before the first compile."""
    with _LOCK:
        if "numba.np.arraymath" in sys.modules or _PROBED in sys.modules:
            return  # set up already, or SciPy's BLAS bindings imported anyway: nothing to save
        from llvmlite import binding as llvm
        from numba.core import config

        if config.CPU_NAME is None and config.CPU_FEATURES is None:  # before numba's code generator exists
            config.CPU_FEATURES = cpu_features(llvm.get_host_cpu_features().flatten())
        from numba.core.registry import cpu_target  # imports SciPy's top-level package when installed (cheap)

        sys.modules[_PROBED] = None  # makes `import scipy.linalg.cython_blas` fail at once, before scipy.linalg
        try:
            cpu_target.target_context.refresh()  # what the first compile or cache load does
        finally:
            del sys.modules[_PROBED]
        from numba.np import arraymath

        arraymath._HAVE_BLAS = "scipy" in sys.modules
