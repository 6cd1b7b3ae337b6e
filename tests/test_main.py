"""``python -m ropelib``: version, device and backends, checked against sources other than the code under test."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ropelib
from ropelib.__main__ import RUN_PATHS, check_paths, main

ROOT = Path(__file__).resolve().parent.parent


def pyproject_version() -> str:
    match = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert match is not None, "pyproject.toml has no static version"
    return match.group(1)


def test_package_version_matches_pyproject() -> None:
    assert ropelib.__version__ == pyproject_version()


def test_module_entry_point_prints_version_device_and_backends() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ropelib"], capture_output=True, text=True, check=True, cwd=ROOT, timeout=120
    )
    lines = result.stdout.splitlines()
    assert lines[0] == f"ropelib {pyproject_version()}"
    assert f"torch {torch.__version__}" in lines[1]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert lines[2].startswith(f"device: {device} (")
    assert lines[3] == "ways to run the rotation:"
    names = [line.split()[0] for line in lines[4:]]
    assert names == ["torch", "triton", "compile"]
    assert lines[4].split()[1] == "usable"  # the PyTorch path runs everywhere


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ropelib {pyproject_version()}"


def test_running_torch_and_triton_backends_matches_reference() -> None:
    # torch always runs; triton runs compiled on CUDA, in the interpreter elsewhere (TRITON_INTERPRET=1).
    statuses = check_paths(["torch", "triton"], run=True)
    assert [s.name for s in statuses] == ["torch", "triton"]
    assert statuses[0].usable and "matches the reference" in statuses[0].detail
    # triton is installed with the test requirements, so its kernel must run here and match
    pytest.importorskip("triton")
    assert statuses[1].usable and "matches the reference" in statuses[1].detail, statuses[1].detail


def test_a_broken_backend_is_reported_unusable(monkeypatch: pytest.MonkeyPatch) -> None:
    import ropelib.kernels

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(ropelib.kernels, "rotary_qk", broken)
    (status,) = check_paths(["torch"], run=True)
    assert not status.usable and "RuntimeError: no kernel image" in status.detail


def test_unknown_backend_name() -> None:
    with pytest.raises(ValueError, match="names must be drawn from"):
        check_paths(["cuda"])
    assert RUN_PATHS == ("torch", "triton", "compile")
