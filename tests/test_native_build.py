"""The native kernel's build (ropelib.kernels.native_build): cached on disk, built once, loud when it fails.

Builds here go to temporary cache folders and use a stand-in compiler (a shell script around the
real one) that logs each compilation, sleeps to widen the window for races, or fails on purpose.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import ropelib
from ropelib.kernels import native_build, native_kernel, registry, torch_kernel

pytestmark = pytest.mark.skipif(
    not native_build.enabled(), reason="the native kernel is off (ROPELIB_CPU_COMPILE=0 or no C compiler)"
)
ROOT = Path(__file__).resolve().parents[1]
REAL_CC = native_build.compiler()


def stand_in_compiler(folder: Path, *, sleep: float = 0.0, fail: str | None = None) -> tuple[Path, Path]:
    """A compiler script in ``folder`` that logs each compilation to the returned log (or fails, printing ``fail``)."""
    log = folder / "compilations.log"
    script = folder / "cc.sh"
    body = f'echo "{fail}" >&2; exit 1' if fail else f'echo run >> "{log}"; sleep {sleep}; exec "{REAL_CC}" "$@"'
    script.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            if [ "$1" = "--version" ]; then exec "{REAL_CC}" --version; fi
            {body}
            """)
    )
    script.chmod(0o755)
    return script, log


def compilations(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> native_build.NativeBuild:
    """A build of its own, with an empty cache folder."""
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache"))
    return native_build.NativeBuild(native_kernel.verify)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300
    )


LOADS = "from ropelib.kernels import native_kernel; print(native_kernel.BUILD.library().compiled)"


def test_a_later_process_loads_the_cache_without_compiling(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    first, second = (run_python(LOADS, ROPELIB_CACHE_DIR=cache) for _ in range(2))
    assert first.stdout.split() == ["True"], first.stderr
    assert second.stdout.split() == ["False"], second.stderr
    assert len(list(Path(cache).glob("rotate-*.so"))) == 1


def test_concurrent_processes_build_once(tmp_path: Path) -> None:
    cc, log = stand_in_compiler(tmp_path, sleep=1.0)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CC": str(cc), "ROPELIB_CACHE_DIR": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen([sys.executable, "-c", LOADS], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = sorted(p.communicate(timeout=300)[0].split()[-1] for p in procs)
    assert outputs == ["False", "False", "True"]  # one compiled; the others waited at the lock and loaded it
    assert compilations(log) == 1


def test_threads_share_one_build(
    fresh: native_build.NativeBuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cc, log = stand_in_compiler(tmp_path, sleep=0.5)
    monkeypatch.setenv("CC", str(cc))
    found: list[native_build.Library] = []
    threads = [threading.Thread(target=lambda: found.append(fresh.library())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(found) == 8 and all(library is found[0] for library in found)
    assert compilations(log) == 1


def _child_rotates(build: native_build.NativeBuild) -> int:
    """In a forked child (one thread, as a DataLoader worker): 0 when the library rotates as the PyTorch kernel."""
    try:
        torch.set_num_threads(1)
        library = build.library()
        q, k = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 1, 16)
        cos, sin = ropelib.RotaryEmbedding(16).cos_sin(torch.arange(8))
        positions = torch.randint(0, 8, (2, 5))
        want = [torch.empty_like(q), torch.empty_like(k)]
        got = [torch.empty_like(q), torch.empty_like(k)]
        torch_kernel.launch(q, k, *want, cos, sin, positions, interleaved=False, conjugate=False)
        native_kernel._launch(library, q, k, *got, cos, sin, positions, interleaved=False, conjugate=False)
        return 0 if torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]) else 3
    except BaseException:
        return 2


def _fork(build: native_build.NativeBuild) -> int:
    pid = os.fork()
    if pid == 0:  # the child
        os._exit(_child_rotates(build))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_gets_the_loaded_library() -> None:
    native_kernel.BUILD.library()
    assert _fork(native_kernel.BUILD) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_during_the_build_gets_the_library(
    fresh: native_build.NativeBuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The parent's build thread holds the build's lock and the file lock while the compiler runs; the
    # child has no such thread. Its own first call must neither hang nor fail: it waits at the file
    # lock for the parent's compile, then loads the finished library.
    cc, log = stand_in_compiler(tmp_path, sleep=1.5)
    monkeypatch.setenv("CC", str(cc))
    parent = threading.Thread(target=fresh.library)
    parent.start()
    deadline = time.monotonic() + 30
    while compilations(log) == 0 and time.monotonic() < deadline:  # the compiler has started
        time.sleep(0.02)
    assert fresh.status().startswith("not built")  # forked mid-build
    assert _fork(fresh) == 0
    parent.join(120)
    assert compilations(log) == 1  # the child loaded the parent's build


def test_a_failed_build_is_logged_once_and_auto_falls_back(
    fresh: native_build.NativeBuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cc, _ = stand_in_compiler(tmp_path, fail="rotate.c:1: error: the stand-in compiler refuses")
    monkeypatch.setenv("CC", str(cc))
    with caplog.at_level(logging.WARNING, logger="ropelib"):
        assert fresh.available() is False
        assert fresh.available() is False  # the second call asks nobody again
    records = [r for r in caplog.records if r.name == "ropelib"]
    assert len(records) == 1 and "the stand-in compiler refuses" in records[0].getMessage()
    assert "not available" in fresh.status()
    monkeypatch.setattr(registry, "BUILD", fresh)  # this process's build, failed
    monkeypatch.setattr(native_kernel, "BUILD", fresh)
    assert ropelib.choose_kernel("auto", "cpu") == "torch"
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    cos, sin = ropelib.RotaryEmbedding(8).cos_sin_cache(3)
    with pytest.raises(ValueError, match="the stand-in compiler refuses"):
        ropelib.rotary_qk(q, k, cos, sin, kernel="native")
    want = ropelib.rotary_qk(q, k, cos, sin, kernel="torch")
    assert torch.equal(ropelib.rotary_qk(q, k, cos, sin)[0], want[0])


def test_a_library_of_another_abi_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "stale.c"
    source.write_text("long long ropelib_abi(void) { return 99; }\nlong long ropelib_call_size(void) { return 8; }\n")
    library = tmp_path / "stale.so"
    subprocess.run([REAL_CC, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    with pytest.raises(native_build.BuildFailed, match="ABI"):
        native_build._load(library, compiled=False)


def test_the_cache_key_follows_source_flags_and_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert REAL_CC is not None
    key = native_build.cache_key(REAL_CC, native_build.FLAGS[0])
    assert key == native_build.cache_key(REAL_CC, native_build.FLAGS[0])  # stable
    assert key != native_build.cache_key(REAL_CC, native_build.FLAGS[2])
    fake, _ = stand_in_compiler(tmp_path)
    other = tmp_path / "other.sh"  # another compiler: its --version differs
    other.write_text('#!/bin/sh\necho "another compiler 1.0"\n')
    other.chmod(0o755)
    assert native_build.cache_key(str(fake), native_build.FLAGS[0]) == key  # same --version, same compiler
    assert native_build.cache_key(str(other), native_build.FLAGS[0]) != key
    edited = [tmp_path / p.name for p in native_build.SOURCES]
    for copy, original in zip(edited, native_build.SOURCES):
        copy.write_text(original.read_text() + "\n/* an edit */\n")
    monkeypatch.setattr(native_build, "SOURCES", tuple(edited))
    assert native_build.cache_key(REAL_CC, native_build.FLAGS[0]) != key


def test_the_first_call_gives_the_bits_of_every_later_one(tmp_path: Path) -> None:
    # A fresh process with an empty cache: its first call waits for the build, so it is served by
    # the same kernel, with the same bits, as its later calls (no call is served by another path).
    code = textwrap.dedent("""\
        import torch, ropelib
        q, k = torch.randn(2, 64, 4, 64), torch.randn(2, 64, 2, 64)
        cos, sin = ropelib.RotaryEmbedding(64).cos_sin(torch.arange(64))
        first = ropelib.rotary_qk(q, k, cos, sin)
        later = [ropelib.rotary_qk(q, k, cos, sin) for _ in range(20)][-1]
        torch_kernel = ropelib.rotary_qk(q, k, cos, sin, kernel="torch")
        same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, later, torch_kernel))
        print(ropelib.choose_kernel("auto", "cpu"), same)
        """)
    result = run_python(code, ROPELIB_CACHE_DIR=str(tmp_path / "cache"))
    assert result.stdout.split() == ["native", "True"], result.stderr


def test_turned_off_by_the_environment() -> None:
    code = textwrap.dedent("""\
        import torch, ropelib
        print(ropelib.choose_kernel("auto", "cpu"))
        q = torch.randn(1, 2, 1, 8)
        cos, sin = ropelib.RotaryEmbedding(8).cos_sin_cache(2)
        try:
            ropelib.rotary_qk(q, q, cos, sin, kernel="native")
        except ValueError as error:
            print("refused:", error)
        """)
    result = run_python(code, ROPELIB_CPU_COMPILE="0")
    lines = result.stdout.splitlines()
    assert lines[0] == "torch", result.stderr
    assert lines[1].startswith("refused:") and "ROPELIB_CPU_COMPILE=0" in lines[1]


def test_python_m_ropelib_check_shows_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = run_python(
        "import sys, ropelib.__main__ as m; sys.exit(m.main(['--check']))", ROPELIB_CACHE_DIR=str(cache)
    )
    native = next(line for line in result.stdout.splitlines() if line.strip().startswith("native"))
    assert "usable" in native and str(cache) in native, result.stdout
