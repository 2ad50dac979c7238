"""CI runs the README's test command, and under CI=true a test that cannot run fails instead of skipping."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    """The command of the README's "Install and run the tests" block (its last line)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"Install and run the tests.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no 'Install and run the tests' bash block"
    return block.group(1).strip().splitlines()[-1]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    command = readme_test_command()
    assert command == "python -m pytest -q -n auto"
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert any(line == command or line.startswith(f"{command} ||") for line in lines)
    assert "export CI=true" in lines


SAMPLE = ("import pytest\n\n"
          "@pytest.mark.oracle\n"
          "def test_needs_an_extra():\n    pytest.importorskip('no_such_module_here', reason='extra missing')\n\n"
          "def test_runs():\n    assert True\n")


def run_pytest(tmp_path: Path, ci: bool, sample: str = SAMPLE, plugin: str = "", args: tuple[str, ...] = (),
               ) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """pytest under the project's conftest on ``sample`` (test_sample.py), with ``plugin`` (the text of a plugin
    module loaded by ``-p``) if given and more command-line ``args``; the run and the skip report."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(sample, encoding="utf-8")
    plugins = []
    if plugin:
        (tmp_path / "sample_plugin.py").write_text(plugin, encoding="utf-8")
        plugins = ["-p", "sample_plugin"]
    report = tmp_path / "skips.json"
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env |= {"QWEN_SKIP_REPORT": str(report)} | ({"CI": "true"} if ci else {})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "", *plugins,
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", *args, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc, json.loads(report.read_text(encoding="utf-8"))


def test_outside_ci_a_skip_is_printed_with_its_reason(tmp_path: Path) -> None:
    proc, skips = run_pytest(tmp_path, ci=False)
    assert proc.returncode == 0, proc.stdout
    assert "SKIPPED" in proc.stdout and "extra missing" in proc.stdout
    assert skips == []


def test_under_ci_a_skip_is_a_failure_and_is_reported(tmp_path: Path) -> None:
    proc, skips = run_pytest(tmp_path, ci=True)
    assert proc.returncode == 1, proc.stdout
    assert "1 failed, 1 passed" in proc.stdout and "extra missing" in proc.stdout
    assert [(s["nodeid"].split("::")[-1], "oracle" in s["markers"]) for s in skips] == [("test_needs_an_extra", True)]


def test_under_ci_only_a_missing_instruction_set_may_skip(tmp_path: Path) -> None:
    """A ``cpu`` marker this CPU does not meet skips under CI=true too (and is reported); one it meets runs."""
    proc, skips = run_pytest(
        tmp_path, ci=True,
        sample="import pytest\n\n"
               "@pytest.mark.cpu('amx')\ndef test_tiles():\n    raise AssertionError('ran without the tiles')\n\n"
               "@pytest.mark.cpu('avx2')\ndef test_vectors():\n    assert True\n",
        plugin="import sys\n\ndef pytest_collection(session):\n"
               "    sys.modules['conftest'].cpu_has = lambda name: name != 'amx'\n")
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 1 skipped" in proc.stdout and "not on this CPU: amx" in proc.stdout
    assert [(s["nodeid"].split("::")[-1], "cpu" in s["markers"]) for s in skips] == [("test_tiles", True)]


def test_the_skip_report_holds_every_workers_skips(tmp_path: Path) -> None:
    """Under pytest-xdist (README's ``-n auto``) each worker's skips reach the one report, and no part is left."""
    sample = "".join(f"@pytest.mark.oracle\ndef test_needs_{i}():\n    pytest.skip('extra missing')\n\n"
                     for i in range(4))
    proc, skips = run_pytest(tmp_path, ci=True, sample="import pytest\n\n" + sample, args=("-n", "2"))
    assert proc.returncode == 1, proc.stdout
    assert "4 failed" in proc.stdout
    assert sorted(s["nodeid"].split("::")[-1] for s in skips) == [f"test_needs_{i}" for i in range(4)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("skips.json")) == ["skips.json"]
