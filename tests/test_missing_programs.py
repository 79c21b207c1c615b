"""A test that needs a program the machine lacks fails with one line: the program, and the
command that installs it (scripts/test installs them all on a bare machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.programs import PACKAGES, TEST_PROGRAMS, MissingProgram, require

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("program", TEST_PROGRAMS)
def test_a_missing_program_is_named_with_its_package(program: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(MissingProgram) as missing:
        require(program)
    assert str(missing.value).startswith(f"{program} is not installed: apt-get install {PACKAGES[program]} ")


def test_the_failure_of_a_test_whose_program_is_missing_is_that_one_line(tmp_path: Path) -> None:
    test = tmp_path / "test_needs_prometheus.py"
    test.write_text("from loadtest.programs import require\n\n\ndef test_it():\n    require('prometheus')\n")
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.missing_programs",
            "-p",
            "no:cacheprovider",
            "-q",
            str(test),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stdout and "def test_it" not in result.stdout
    line = "prometheus is not installed: apt-get install prometheus (scripts/test installs it)"
    assert f"FAILED test_needs_prometheus.py::test_it - {line}" in result.stdout


def test_scripts_test_installs_the_package_of_every_program_the_tests_run() -> None:
    script = (ROOT / "scripts" / "test").read_text()
    for program in TEST_PROGRAMS:
        assert f"{program}:{PACKAGES[program]}" in script
