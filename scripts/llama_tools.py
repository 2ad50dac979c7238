"""llama.cpp's command-line tools (``llama-imatrix``, ``llama-quantize``, ``llama-server``) and its shared
libraries (the peer's ``libllama.so``), built once from the vendored source into one tree.

The llama.cpp source comes from llama-cpp-python's sdist (``vendor/llama.cpp``, downloaded with ``pip download``
as in :mod:`llama_interop`) of the installed version, or before it is installed of the version pyproject's
``peer`` extra pins; it is unpacked into ``<cache>/llama.cpp-<version>/`` and built with cmake into
``<cache>/llama.cpp-<version>/build-shared/bin/``. The cache defaults to ``~/.cache/qwen-numpy`` (override with
``QWEN_LLAMA_TOOLS_CACHE``); nothing of it is committed. Several processes may ask at once: unpacking and building
run under an exclusive ``flock`` on ``<cache>/llama.cpp-<version>/.lock``, and a target already built is not
rebuilt.

One tree serves the tools and the peer, so CI compiles llama.cpp once: the libraries are shared (the tools link
them), and ``.ci/run`` installs llama-cpp-python without its own build of llama.cpp (``-DLLAMA_BUILD=OFF``) and
points it here with ``LLAMA_CPP_LIB_PATH`` (:func:`peer_library_dir`; ``tests/conftest.py`` does the same for a
lib-less install). The tree has the server on, without HTTPS and without downloading the web UI, and on CPUs that
advertise AMX it is built for the host without llama.cpp's AMX path, which segfaults in the first decode of
quantized models on these VMs.

Usage: ``python scripts/llama_tools.py [llama-imatrix llama-quantize llama-server llama]`` builds and prints the
paths (``llama`` is the peer's shared library).
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import llama_interop as li

TARGETS = ("llama-imatrix", "llama-quantize")
SERVER = "llama-server"
LIBRARY = "llama"  # the shared library llama-cpp-python loads (libllama.so, beside the ggml libraries it links)
BUILD_DIR = "build-shared"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
# The host's instruction sets without AMX (every flag is implied by AMX hardware; the same as .ci/run's CMAKE_ARGS).
NO_AMX_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_FMA=ON",
                "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
                "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                "-DGGML_AMX_BF16=OFF")
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def cmake_flags() -> tuple[str, ...]:
    return CMAKE_FLAGS + (NO_AMX_FLAGS if cpu_has_amx() else ())


def pinned_version() -> str:
    """The llama-cpp-python version pyproject's ``peer`` extra pins (the source to build before it is installed)."""
    pin = re.search(rf'^peer = \[.*"{re.escape(li.DIST_NAME)}==([^"]+)"', PYPROJECT.read_text(encoding="utf-8"), re.M)
    if pin is None:
        raise li.ConverterUnavailable(f"{PYPROJECT}: the peer extra does not pin {li.DIST_NAME}==<version>")
    return pin.group(1)


def output_name(target: str) -> str:
    return f"lib{target}.so" if target == LIBRARY else target


def cache_root() -> Path:
    return Path(os.environ.get("QWEN_LLAMA_TOOLS_CACHE", Path.home() / ".cache" / "qwen-numpy"))


def tool_root(version: str | None = None) -> Path:
    return cache_root() / f"llama.cpp-{version or li.installed_version() or pinned_version()}"


def peer_library_dir(version: str | None = None) -> Path:
    """Where the built ``libllama.so`` and its ggml libraries are (``LLAMA_CPP_LIB_PATH`` for llama-cpp-python)."""
    return tool_root(version) / BUILD_DIR / "bin"


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _unpack_source(root: Path, version: str) -> Path:
    """``root/src``: the sdist's vendor/llama.cpp tree (downloaded once into ``root``)."""
    source = root / "src"
    if (source / "CMakeLists.txt").is_file():
        return source
    sdists = sorted(root.glob(f"llama_cpp_python-{version}.tar.gz")) or [li._download_sdist(root, version)]
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    staging = root / "src.tmp"
    with tarfile.open(sdists[0]) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix) and len(member.name) > len(prefix):
                member.name = member.name[len(prefix):]
                members.append(member)
        tar.extractall(staging, members=members, filter="data")
    staging.rename(source)
    return source


def build_tools(targets: Sequence[str] = TARGETS, jobs: int = 2, version: str | None = None) -> dict[str, Path]:
    """Paths of the built ``targets`` (built on first use; later calls only check the files exist)."""
    version = version or li.installed_version() or pinned_version()
    root = tool_root(version)
    build = root / BUILD_DIR
    outputs = {t: build / "bin" / output_name(t) for t in targets}
    if all(p.is_file() for p in outputs.values()):
        return outputs
    with _locked(root):
        missing = [t for t, p in outputs.items() if not p.is_file()]
        if missing:
            source = _unpack_source(root, version)
            if not (build / "CMakeCache.txt").is_file():
                _run(["cmake", "-S", str(source), "-B", str(build), *cmake_flags()])
            _run(["cmake", "--build", str(build), "--target", *missing, "-j", str(jobs)])
    for target, path in outputs.items():
        if not path.is_file():
            raise li.ConverterUnavailable(f"building {target} did not produce {path}")
    return outputs


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise li.ConverterUnavailable(f"{' '.join(cmd[:3])} failed:\n{(done.stdout + done.stderr)[-3000:]}")


if __name__ == "__main__":
    jobs = int(os.environ.get("QWEN_LLAMA_BUILD_JOBS", os.cpu_count() or 2))
    for name, path in build_tools(sys.argv[1:] or TARGETS, jobs=jobs).items():
        print(name, path)
