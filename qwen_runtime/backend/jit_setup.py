"""numba's start-up without the part our kernels do not use: the SciPy import of its BLAS probe.

The first kernel a process compiles or loads from numba's cache makes numba set up its CPU target, which
imports ``numba.np.arraymath``; at import that module probes for BLAS with ``import scipy.linalg.cython_blas``,
which imports all of ``scipy.linalg`` (with SciPy installed: a large share of numba's warm-cache start-up,
docs/performance.md).  The probe only chooses, for ``np.correlate``/``np.convolve`` in compiled code,
between ``np.dot`` and a plain loop; none of our kernels calls them, nor any BLAS from compiled code.

:func:`prepare_numba` runs that set-up (numba's own, in its own order, only earlier) with
``scipy.linalg.cython_blas`` unimportable for the duration, then sets the probe's result to what it would have
been (SciPy present), so other compiled code in the process behaves as with numba alone (numba's BLAS and LAPACK
functions import SciPy themselves when first compiled).

It also lets LLVM use 512-bit vectors on CPUs with AVX-512 (:func:`cpu_features`): LLVM's tuning for Intel's
AVX-512 cores ("prefer-256-bit") splits the kernels' loops into 256-bit halves, which made the row kernels
slower (docs/performance.md).  numba keys its on-disk cache by the features, so cached code never
mixes the two; a user's ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` is left alone.

Finally it makes numba's on-disk cache notice edits of the modules a kernel's module imports
(:class:`KernelSourcesLocator`).  numba stamps a cached function with a hash of its own file only, while our
kernels inline intrinsics and helpers from other modules of the package and freeze their constants (the
stack accumulators' alignment of ``backend/kernels/base.py``, the tables of ``quants/iq4.py``): after an edit of
``kernels/base.py`` alone, ``kernels/dense.py``'s cached code from before the edit was loaded and crashed (an update by
``git pull`` rewrites only the changed files).  The stamp of a function of this package therefore also covers
every module of the package its module imports, transitively (:func:`import_closure`).

With ``NUMBA_CACHE_DIR`` set, the locator also files a module's code under that hash rather than under the
checkout's path (numba's own choice): a fresh clone, a CI checkout or a second worktree of the same sources loads
what any other compiled, and two versions of a module never overwrite each other's index.  (CI clones the project
afresh each run, and the first compile of every kernel module is a large part of its time.)
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
import threading
from pathlib import Path

from .memory import MADV_PAGEOUT, advise, mapped_ranges

_PROBED = "scipy.linalg.cython_blas"  # what numba.np.arraymath imports to probe for BLAS
_LOCK = threading.Lock()  # models loaded in two threads at once set numba up once
PACKAGE = Path(__file__).resolve().parents[1]  # qwen_runtime: its compiled functions get the wider stamp
_PACKAGES = [PACKAGE]  # and those of the packages that :func:`prepare_numba` was given
# `from .x import a, b` / `from ..x.y import (a, b)` / `from qwen_runtime.x import a`: the dots, the module, the names.
_IMPORT = re.compile(r"^from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(?:\(([^)]*)\)|([\w \t,]+))", re.MULTILINE)


def cpu_features(host: str) -> str | None:
    """numba's CPU features for the host's LLVM feature string ``host``: with AVX-512, the same without LLVM's
    preference for 256-bit vectors; None (numba's own choice) otherwise."""
    return f"{host},-prefer-256-bit" if "+avx512f" in host.split(",") else None


# The CPU features of the kernels' other instruction forms (``NUMBA_CPU_FEATURES``): AVX2 without AVX-512 (sums of 4
# from ``pmaddubsw``; no table lookups) and AVX-512 without VNNI (Q8_0's sums of 4 from ``pmaddwd``).
AVX2_FEATURES = "+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt,+bmi,+bmi2"


def other_instruction_forms(host: str) -> dict[str, str]:
    """The ``NUMBA_CPU_FEATURES`` under which the kernels take their other instruction forms and the host (its LLVM
    feature string) still runs them, by name: what the tests compile them for besides the host's own form.  On a
    host without AVX-512 the AVX2 form is its own (the kernels branch on AVX-512 only), so it is not another."""
    flags = host.split(",")
    forms = {"avx2": AVX2_FEATURES} if {"+avx2", "+avx512f"} <= set(flags) else {}
    if "+avx512vnni" in flags:
        forms["avx512 without vnni"] = ",".join("-avx512vnni" if f == "+avx512vnni" else f for f in flags)
    return forms


def prepare_numba(package: Path | None = None) -> None:
    """Set up numba's CPU target without its SciPy import, once per process, before the first compile; whatever
    came first (SciPy's BLAS bindings imported by another library, or numba set up already), the cache locator and,
    while numba's code generator does not exist yet, the CPU features are ours: otherwise that process would key
    its cache apart from every other and compile every kernel afresh.  ``package``: the directory of another
    package whose compiled functions the locator files and stamps as this one's (the converter's searches)."""
    with _LOCK:
        if package is not None and package.resolve() not in _PACKAGES:
            _PACKAGES.append(package.resolve())
            import_closure.cache_clear()
        from numba.core import config

        if "numba.np.arraymath" not in sys.modules:  # numba's code generator does not exist yet
            if config.CPU_NAME is None and config.CPU_FEATURES is None:
                from llvmlite import binding as llvm

                config.CPU_FEATURES = cpu_features(llvm.get_host_cpu_features().flatten())
            if _PROBED not in sys.modules:  # (imported anyway: nothing to save)
                _set_up_without_scipy_blas()
        use_kernel_sources_locator()


def _set_up_without_scipy_blas() -> None:
    """numba's target set-up with ``scipy.linalg.cython_blas`` unimportable, then its BLAS probe's result as it
    would have been."""
    from numba.core.registry import cpu_target  # imports SciPy's top-level package when installed (cheap)

    sys.modules[_PROBED] = None  # makes `import scipy.linalg.cython_blas` fail at once, before scipy.linalg
    try:
        cpu_target.target_context.refresh()  # what the first compile or cache load does
    finally:
        del sys.modules[_PROBED]
    from numba.np import arraymath

    arraymath._HAVE_BLAS = "scipy" in sys.modules


def release_compiler_pages() -> int:
    """Ask the kernel to reclaim the resident pages of LLVM's code (the read-only mappings of llvmlite's library):
    about 68 MiB that numba touches while it loads kernels from its cache, and not again until it compiles
    something (then they fault back in from the file).  Called once a model's compiled code is loaded and before
    its weights are read (``models.warm_up``), so that the process's peak resident memory is the weights, not the
    weights plus the compiler.  Linux only; elsewhere, or when the kernel refuses, nothing happens.  Returns the
    bytes advised."""
    return sum(end - start for start, end, mode in mapped_ranges("libllvmlite")
               if "w" not in mode and advise(start, end - start, MADV_PAGEOUT))


def imported_files(path: Path, *roots: Path) -> list[Path]:
    """The files of the packages at ``roots`` that the module ``path`` imports from (``from`` imports, relative or
    by a package's name; modules and packages named as imported names included)."""
    by_name = {root.name: root for root in roots}
    found = []
    for dots, module, grouped, names in _IMPORT.findall(path.read_text(encoding="utf-8")):
        names = re.sub(r"#.*", "", grouped or names)
        if dots:
            base = path.parent.parents[len(dots) - 2] if len(dots) > 1 else path.parent
        elif module.split(".")[0] in by_name:
            base, module = by_name[module.split(".")[0]], module.partition(".")[2]
        else:
            continue
        target = base.joinpath(*module.split(".")) if module else base
        candidates = [target.with_suffix(".py"), target / "__init__.py"]
        candidates += [target / f"{name.strip()}.py" for name in names.split(",") if name.strip()]
        found += [c.resolve() for c in candidates if c.is_file()]
    return [f for f in found if any(root in f.parents for root in roots)]


def owning_package(path: Path) -> Path | None:
    """The package of :data:`_PACKAGES` that holds the file ``path``, if any."""
    return next((root for root in _PACKAGES if root in path.resolve().parents), None)


@functools.cache
def import_closure(path: Path, *roots: Path) -> str:
    """A hash of ``path`` and of every file of the packages ``roots`` (by default this package and those given to
    :func:`prepare_numba`) it imports from, transitively; each file is named relative to its package's parent, so
    the hash is the same in every checkout of the same sources."""
    roots = roots or tuple(_PACKAGES)
    seen, todo = set(), [path.resolve()]
    while todo:
        file = todo.pop()
        if file not in seen:
            seen.add(file)
            todo += imported_files(file, *roots)
    named = {}
    for file in seen:
        root = next((r for r in roots if r in file.parents), None)
        named[(file.relative_to(root.parent) if root else Path(file.name)).as_posix()] = file
    digest = hashlib.sha256()
    for name in sorted(named):
        digest.update(name.encode() + b"\0" + named[name].read_bytes())
    return digest.hexdigest()


def caching_class(name: str) -> type:
    """Class ``name`` of numba's cache machinery (numba < 0.62 names it privately, with a leading underscore)."""
    from numba.core import caching

    return getattr(caching, name, None) or getattr(caching, f"_{name}")


def use_kernel_sources_locator() -> None:
    """Put :class:`KernelSourcesLocator` first in numba's cache locators (once)."""
    impl = caching_class("CacheImpl")
    if KernelSourcesLocator.wrapper() not in impl._locator_classes:
        impl._locator_classes.insert(0, KernelSourcesLocator.wrapper())


class KernelSourcesLocator:
    """Where numba would cache a function of this package, stamped with :func:`import_closure` as well (the class
    numba uses is :meth:`wrapper`'s, a subclass of numba's locator base built when numba is set up)."""

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def wrapper() -> type:
        from numba.core import caching, config

        class Locator(caching._CacheLocator):
            def __init__(self, inner: object, py_file: str) -> None:
                self._inner, self._py_file = inner, Path(py_file)

            def get_cache_path(self) -> str:
                if not isinstance(self._inner, caching_class("UserProvidedCacheLocator")):
                    return self._inner.get_cache_path()  # numba's __pycache__ beside the module
                module = self._py_file.resolve().relative_to(owning_package(self._py_file).parent).with_suffix("")
                return str(Path(config.CACHE_DIR, f"{'.'.join(module.parts)}-{import_closure(self._py_file)[:20]}"))

            def get_source_stamp(self) -> object:
                return self._inner.get_source_stamp(), import_closure(self._py_file)

            def get_disambiguator(self) -> str:
                return self._inner.get_disambiguator()

            @classmethod
            def from_function(cls, py_func: object, py_file: str) -> object:
                if owning_package(Path(py_file)) is None:
                    return None
                for locator in caching_class("CacheImpl")._locator_classes:
                    inner = None if locator is cls else locator.from_function(py_func, py_file)
                    if inner is not None:
                        return cls(inner, py_file)
                return None

        Locator.__name__ = Locator.__qualname__ = "KernelSourcesLocator"
        return Locator
