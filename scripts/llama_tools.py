"""llama.cpp's command-line tools (``llama-imatrix``, ``llama-quantize``, ``llama-server``) built once from the
vendored source.

The llama.cpp source comes from the installed llama-cpp-python's sdist (``vendor/llama.cpp``, downloaded with
``pip download`` as in :mod:`llama_interop`), is unpacked into ``<cache>/llama.cpp-<version>/`` and built there with
cmake (``<cache>/llama.cpp-<version>/build/bin/``).  The cache defaults to ``~/.cache/qwen-numpy`` (override with
``QWEN_LLAMA_TOOLS_CACHE``); nothing of it is committed.  Several processes may ask at once: unpacking and
building run under an exclusive ``flock`` on ``<cache>/llama.cpp-<version>/.lock``, and a target already built is
not rebuilt.

``llama-server`` (the peer of ``scripts/bench_serve.py``) is built in a tree of its own, ``build-server/``, without
HTTPS and without downloading the web UI, and on CPUs that advertise AMX without llama.cpp's AMX path (it
segfaults in the first decode of quantized models on these VMs; the flags are ``.ci/run``'s).

Usage: ``python scripts/llama_tools.py [llama-imatrix llama-quantize llama-server]`` builds and prints the
binaries' paths.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import llama_interop as li

TARGETS = ("llama-imatrix", "llama-quantize")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF")
SERVER = "llama-server"
SERVER_FLAGS = (*CMAKE_FLAGS[:-2], "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
# The host's instruction sets without AMX (every flag is implied by AMX hardware; the same as .ci/run's CMAKE_ARGS).
NO_AMX_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_FMA=ON",
                "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
                "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                "-DGGML_AMX_BF16=OFF")


def cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def build_config(target: str) -> tuple[str, tuple[str, ...]]:
    """The build directory (under the tool root) and cmake flags of ``target``."""
    if target == SERVER:
        return "build-server", SERVER_FLAGS + (NO_AMX_FLAGS if cpu_has_amx() else ())
    return "build", CMAKE_FLAGS


def cache_root() -> Path:
    return Path(os.environ.get("QWEN_LLAMA_TOOLS_CACHE", Path.home() / ".cache" / "qwen-numpy"))


def tool_root(version: str | None = None) -> Path:
    version = version or li.installed_version()
    if version is None:
        raise li.ConverterUnavailable(f"{li.DIST_NAME} is not installed")
    return cache_root() / f"llama.cpp-{version}"


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


def build_tools(targets: Sequence[str] = TARGETS, jobs: int = 2) -> dict[str, Path]:
    """Paths of the built ``targets`` (built on first use; later calls only check the binaries exist)."""
    version = li.installed_version()
    root = tool_root(version)
    binaries = {t: root / build_config(t)[0] / "bin" / t for t in targets}
    if all(p.is_file() for p in binaries.values()):
        return binaries
    with _locked(root):
        missing = [t for t, p in binaries.items() if not p.is_file()]
        if missing:
            source = _unpack_source(root, version)
        for directory, flags in sorted({build_config(t) for t in missing}):
            build = root / directory
            if not (build / "CMakeCache.txt").is_file():
                _run(["cmake", "-S", str(source), "-B", str(build), *flags])
            _run(["cmake", "--build", str(build), "--target", *[t for t in missing if build_config(t)[0] == directory],
                  "-j", str(jobs)])
    for target, path in binaries.items():
        if not path.is_file():
            raise li.ConverterUnavailable(f"building {target} did not produce {path}")
    return binaries


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise li.ConverterUnavailable(f"{' '.join(cmd[:3])} failed:\n{(done.stdout + done.stderr)[-3000:]}")


if __name__ == "__main__":
    for name, path in build_tools(sys.argv[1:] or TARGETS).items():
        print(name, path)
