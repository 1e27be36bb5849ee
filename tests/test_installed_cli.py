"""`pip install` of this checkout puts the `verl-fused-hook` command (A/B script, benchmarks) on the PATH.

The package is installed, non-editable and without dependencies, into a fresh
virtual environment that sees the test interpreter's packages (torch,
megatron-core, verl) through a path file; the installed command is then run
as a user runs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COPY_IGNORED = shutil.ignore_patterns(
    ".git", ".venv", ".test-venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache"
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the venv's bin folder, its python) with this checkout installed in it."""
    root = tmp_path_factory.mktemp("cli")
    source = root / "source"  # a copy: the build writes build/ and *.egg-info next to the sources
    shutil.copytree(REPO, source, ignore=COPY_IGNORED)
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    env_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # the test interpreter's packages (torch, setuptools, ...) without its own copy of verl_fused_hook
    Path(env_site, "test_interpreter_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--quiet",
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return env_dir / "bin", python


def _run(bin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what the venv installed
    environ["PATH"] = f"{bin_dir}{os.pathsep}{environ.get('PATH', '')}"
    return subprocess.run(
        ["verl-fused-hook", *args], capture_output=True, text=True, env=environ, timeout=300, cwd=bin_dir.parent
    )


def test_the_package_is_imported_from_the_venv(installed):
    bin_dir, python = installed
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    location = subprocess.run(
        [str(python), "-c", "import verl_fused_hook_harness.commands.ab.parity as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
        cwd=bin_dir.parent,  # not this checkout
    ).stdout.strip()
    assert Path(location).is_relative_to(bin_dir.parent), location


def test_installed_command_lists_its_tools(installed):
    result = _run(installed[0], "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: verl-fused-hook <command> [args]")
    for command in ("ab-parity", "bench", "e2e-bench"):
        assert f"  {command} " in result.stdout


def test_installed_command_refuses_an_unknown_command(installed):
    result = _run(installed[0], "ab-parity-typo")
    assert result.returncode == 2
    assert result.stderr.startswith(
        "verl-fused-hook: unknown command 'ab-parity-typo'; allowed: ab-parity, bench, e2e-bench"
    )


def test_installed_ab_parity_answers_help(installed):
    result = _run(installed[0], "ab-parity", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: verl-fused-hook ab-parity")
