"""``python -m ropelib``: version, device and kernels, checked against sources other than the code under test."""

from __future__ import annotations

import os
import re
import shutil
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


def c_compiler() -> str | None:
    """A C compiler found on the PATH, as the native kernel looks for one (``$CC``, cc, gcc, clang)."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    return next((path for path in map(shutil.which, names) if path), None)


def native_expected() -> bool:
    return not torch.cuda.is_available() and os.environ.get("ROPELIB_CPU_COMPILE", "1") != "0" and bool(c_compiler())


def test_module_entry_point_prints_version_device_and_kernels() -> None:
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
    assert names == ["torch", "native", "triton", "compile"]
    assert lines[4].split()[1] == "usable"  # the PyTorch path runs everywhere
    if native_expected():  # a C compiler on a CPU machine: the C loop can be built
        assert lines[5].split()[1] == "usable", lines[5]


def test_check_reports_the_native_cache_path(tmp_path: Path) -> None:
    if not native_expected():
        pytest.skip("the native kernel needs a CPU device and a C compiler")
    cache = tmp_path / "ropelib-cache"
    env = {**os.environ, "ROPELIB_CACHE_DIR": str(cache)}
    result = subprocess.run(
        [sys.executable, "-m", "ropelib", "--check"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    (native,) = [line for line in result.stdout.splitlines() if line.split()[:1] == ["native"]]
    assert native.split()[1] == "usable" and "matches the reference" in native, native
    # the library was built into the folder the environment named, and the line says where it is
    libraries = [path for path in cache.iterdir() if path.suffix in (".so", ".dylib", ".dll")]
    assert len(libraries) == 1, list(cache.iterdir())
    assert str(libraries[0]) in native


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ropelib {pyproject_version()}"


def test_running_the_kernels_matches_reference() -> None:
    # torch always runs; native on a CPU with a C compiler; triton compiled on CUDA, in the
    # interpreter elsewhere (TRITON_INTERPRET=1).
    statuses = check_paths(["torch", "native", "triton"], run=True)
    assert [s.name for s in statuses] == ["torch", "native", "triton"]
    assert statuses[0].usable and "matches the reference" in statuses[0].detail
    if native_expected():
        assert statuses[1].usable and "matches the reference" in statuses[1].detail, statuses[1].detail
    # triton is installed with the test requirements, so its kernel must run here and match
    pytest.importorskip("triton")
    assert statuses[2].usable and "matches the reference" in statuses[2].detail, statuses[2].detail


def test_a_broken_kernel_is_reported_unusable(monkeypatch: pytest.MonkeyPatch) -> None:
    import ropelib.kernels

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(ropelib.kernels, "rotary_qk", broken)
    (status,) = check_paths(["torch"], run=True)
    assert not status.usable and "RuntimeError: no kernel image" in status.detail


def test_unknown_kernel_name() -> None:
    with pytest.raises(ValueError, match="names must be drawn from"):
        check_paths(["cuda"])
    assert RUN_PATHS == ("torch", "native", "triton", "compile")
