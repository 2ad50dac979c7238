"""Tests that cannot silently vanish.

Outside CI a test whose extra, data or download is missing may skip; ``-rs`` (pyproject's ``addopts``) prints
every skip with its reason. With ``CI=true`` (``.ci/run`` sets it) a skip is a failure: CI installs every extra
and the repository carries every file the tests read, so a skip there means a test that did not run. Each such
test is also written to the JSON file named by ``QWEN_SKIP_REPORT`` (node id, markers, reason), which ``.ci/run``
reads to fail if any ``oracle`` or ``peer`` test did not run.

llama-cpp-python installed by ``.ci/run`` carries no llama.cpp of its own (it is built once, with the tools, by
``scripts/llama_tools.py``); ``.ci/run`` points it at that build with ``LLAMA_CPP_LIB_PATH``, and so does this file
when the variable is unset, the installed package has no ``lib/libllama.so`` and the build has one, so that the
README's test command runs the peer tests after CI on the same machine too.

A test of instructions the machine's CPU may lack is marked ``cpu(name)``: AMX int8 tiles (``"amx"``) or another
instruction form than the host's own that ``backend.jit_setup.other_instruction_forms`` finds it can run (``"avx2"``
on an AVX-512 host, ``"avx512 without vnni"`` on a VNNI one). Where there is none the test skips, under ``CI=true``
too (no install brings an instruction set), and is still listed in ``QWEN_SKIP_REPORT`` and by ``-rs``; any other
skip stays a failure there.

The README's command runs the tests in one pytest-xdist worker per core, a test file at a time on one worker
(``--dist loadfile``, pyproject's ``addopts``), so a module's fixtures are built once; the skip report is merged
from the workers' parts.

One fixture is shared by the whole suite: ``converted``, the committed fixtures converted in-process once per
session and (name, format, dtype) (``runtime_helpers.Converted``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from runtime_helpers import Converted

STRICT = os.environ.get("CI", "").lower() in ("1", "true", "yes")
_skipped: list[dict[str, Any]] = []
_lacking_cpu: set[str] = set()  # node ids skipped by a ``cpu`` marker this CPU does not meet


def _point_peer_at_built_library() -> None:
    spec = importlib.util.find_spec("llama_cpp")
    if "LLAMA_CPP_LIB_PATH" in os.environ or spec is None or not spec.submodule_search_locations:
        return
    if (Path(next(iter(spec.submodule_search_locations))) / "lib" / "libllama.so").is_file():
        return
    import llama_tools  # scripts/ is on pytest's pythonpath (pyproject)

    built = llama_tools.peer_library_dir()
    if (built / "libllama.so").is_file():
        os.environ["LLAMA_CPP_LIB_PATH"] = str(built)


_point_peer_at_built_library()


def cpu_has(name: str) -> bool:
    """Whether this machine runs what the ``cpu`` marker's ``name`` needs, as another form than its own where
    ``name`` is an instruction form (module docstring)."""
    if name == "amx":
        from qwen_runtime.backend.kernels.amx import amx_available

        return amx_available()
    from llvmlite import binding as llvm

    from qwen_runtime.backend.jit_setup import other_instruction_forms

    if name not in ("avx2", "avx512 without vnni"):
        raise ValueError(f"unknown cpu marker {name!r}")
    return name in other_instruction_forms(llvm.get_host_cpu_features().flatten())


def pytest_runtest_setup(item: pytest.Item) -> None:
    lacking = [name for marker in item.iter_markers("cpu") for name in marker.args if not cpu_has(name)]
    if lacking:
        _lacking_cpu.add(item.nodeid)
        pytest.skip(f"not on this CPU: {', '.join(lacking)}")


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _record(nodeid: str, markers: list[str], reason: str) -> None:
    _skipped.append({"nodeid": nodeid, "markers": markers, "reason": reason})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        _record(item.nodeid, sorted({m.name for m in item.iter_markers()}), reason)
        if item.nodeid in _lacking_cpu:
            return
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (a test that cannot run is a failure there): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if STRICT and report.skipped:
        reason = _reason(report)
        # a module skipped while importing has no items: its markers are unknown, so count it as every group
        _record(report.nodeid, ["collection", "oracle", "peer"], reason)
        report.outcome = "failed"
        report.longrepr = f"module skipped under CI=true (a test that cannot run is a failure there): {reason}"


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Converted:
    """``converted(name, fmt, dtype)``: the path of a fixture converted once per session (read, never change)."""
    from runtime_helpers import Converted  # imported here: tests/test_ci.py runs this file on its own

    return Converted(tmp_path_factory.mktemp("converted"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the skip report: a pytest-xdist worker its own part beside it, the controller (or a run without
    workers) the whole, its own entries and every worker's part, which it removes.

    A worker's session finishes before it tells the controller it is done, so every part is there when the
    controller's session finishes.
    """
    target = os.environ.get("QWEN_SKIP_REPORT")
    if not target:
        return
    report = Path(target)
    worker = getattr(session.config, "workerinput", None)
    if worker is not None:
        report.with_name(f"{report.name}.{worker['workerid']}").write_text(json.dumps(_skipped), encoding="utf-8")
        return
    entries = list(_skipped)
    for part in sorted(report.parent.glob(f"{report.name}.gw*")):
        entries += json.loads(part.read_text(encoding="utf-8"))
        part.unlink()
    report.write_text(json.dumps(entries, indent=1), encoding="utf-8")
