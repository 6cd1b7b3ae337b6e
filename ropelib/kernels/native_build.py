r"""The native kernel's library: its binary interface, and its build, cached on disk as Triton and Inductor cache theirs.

``rotate.c`` (next to this module) is compiled by the system's C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``) into a shared library and loaded with ``ctypes``:

* **Cached.** The library lives in :func:`cache_dir` (``$ROPELIB_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/ropelib`` or ``~/.cache/ropelib``) under a key hashing the source, the flags,
  the compiler's identity, the processor (the code is tuned for it) and the ABI and ropelib
  versions. A later process, another rank, a spawned worker loads it without compiling.
* **Built once.** Concurrent processes take a file lock, and the first writes the library to a
  temporary name and renames it into place (atomic), so the others load the finished file.
  Threads of one process share one build; a process forked during a build, whose build thread
  does not exist in the child, starts afresh (``os.register_at_fork``).
* **Loud.** A failed build is logged once, with the compiler's output, on the ``"ropelib"``
  logger; ``kernel="auto"`` then uses the PyTorch kernel, and ``kernel="native"`` raises with
  that output.
* **Deterministic.** The first call waits for the build (a fraction of a second) or the cache
  (milliseconds) instead of being served by another kernel, so no result depends on timing. The
  flags keep IEEE rounding: ``-ffp-contract=off`` (no fused multiply-add) and no fast-math,
  with ``-march=native`` for vector width only.

``ROPELIB_CPU_COMPILE=0`` turns the library off.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

LOG = logging.getLogger("ropelib")
#: ``ROPELIB_CPU_COMPILE=0`` in the environment turns the native kernel off.
ENV = "ROPELIB_CPU_COMPILE"
#: Where the library is cached (see :func:`cache_dir`).
CACHE_ENV = "ROPELIB_CACHE_DIR"
#: The C source and the loop it includes, shipped with the package.
SOURCES = (Path(__file__).with_name("rotate.c"), Path(__file__).with_name("rotate_loop.h"))
#: The version of ``struct call`` in ``rotate.c``; the loaded library must report the same.
ABI = 4
#: Compiler flags, tried in order. First OpenMP and this processor's vector width, then without
#: OpenMP (Apple's clang has none: one thread), then portable code. Every set keeps IEEE rounding.
FLAGS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O3",),
)
COMMON_FLAGS = ("-ffp-contract=off", "-fno-fast-math", "-fopenmp-simd", "-std=gnu11", "-shared", "-fPIC")
#: GCC's straight-line vectorizer fuses the interleaved pairs' products and sums into ``vfmaddsub``
#: despite ``-ffp-contract=off``; the loops are vectorized by the loop vectorizer all the same.
GCC_FLAGS = ("-fno-tree-slp-vectorize",)
#: The entry points, by the dtype they rotate.
ENTRY_POINTS = MappingProxyType(
    {
        torch.float32: "ropelib_rotate_f32",
        torch.float64: "ropelib_rotate_f64",
        torch.bfloat16: "ropelib_rotate_bf16",
        torch.float16: "ropelib_rotate_f16",
    }
)

_POINTERS = ("q", "k", "q_out", "k_out", "cos", "sin", "pos")
_SIZES = ("batch", "seq", "dim", "r2", "length", "q_heads", "k_heads")
_STRIDES = ("qb", "qs", "qh", "kb", "ks", "kh", "qob", "qos", "qoh", "kob", "kos", "koh", "pb", "ps")
_FLAGS = ("interleaved", "conjugate", "touch", "threads")
#: The key/value-cache write (``slots`` NULL: none): then ``k_out`` is the key cache, its strides
#: ``kob, kos, koh`` those of a block, a row of a block and a head.
_CACHE_POINTERS = ("slots", "v", "v_out")
_CACHE_SIZES = ("v_dim", "block_size", "num_slots", "vb", "vs", "vh", "vob", "vos", "voh", "sb", "ss")


class Call(ctypes.Structure):
    """``struct call`` of ``rotate.c``: the pointers, sizes, strides (in elements) and flags of one rotation."""

    _fields_ = [
        ("abi", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in _POINTERS),
        *((name, ctypes.c_int64) for name in (*_SIZES, *_STRIDES, *_FLAGS)),
        *((name, ctypes.c_void_p) for name in _CACHE_POINTERS),
        *((name, ctypes.c_int64) for name in _CACHE_SIZES),
    ]


#: :class:`Call`'s bytes packed in one step (a fifth of the cost of filling the structure field by
#: field, which matters at a decoding step): the same fields in the same order and layout.
PACKED_CALL = struct.Struct("@" + "".join("P" if field[1] is ctypes.c_void_p else "q" for field in Call._fields_))
if PACKED_CALL.size != ctypes.sizeof(Call):  # not a platform of 64-bit pointers: no packed form
    raise ImportError(f"struct call has {ctypes.sizeof(Call)} bytes here, its packed form {PACKED_CALL.size}")


def compiler() -> str | None:
    """The C compiler to build with: ``$CC`` when set, else the first of ``cc``, ``gcc``, ``clang`` found."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    return next((path for path in map(shutil.which, names) if path), None)


def enabled() -> bool:
    """True unless ``ROPELIB_CPU_COMPILE=0`` or no C compiler is found."""
    return os.environ.get(ENV, "1") != "0" and compiler() is not None


def cache_dir() -> Path:
    """``$ROPELIB_CACHE_DIR``, else ``$XDG_CACHE_HOME/ropelib``, else ``~/.cache/ropelib``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ropelib"


def _processor() -> str:
    """What ``-march=native`` tunes for: the first processor's model and feature flags where Linux says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [
                line for line in f if line.startswith(("vendor_id", "model name", "flags", "Features", "CPU part"))
            ]
        return "".join(dict.fromkeys(lines))
    except OSError:
        return platform.machine() + platform.processor()


def _identity(cc: str) -> str:
    """The compiler's own description of itself (``--version``), or its path when it gives none."""
    try:
        result = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return result.stdout.strip() or cc
    except (OSError, subprocess.SubprocessError):
        return cc


#: On x86-64 with ``-march=native``, the vector width: 512 bits on AMD processors with AVX-512
#: (Zen 4 and later run them at full clock; on a 2-core EPYC the loop ran 5-20% faster in bfloat16
#: and no slower in float32 than with 256), 256 bits elsewhere (Intel parts lower the clock for them).
X86_WIDE_FLAGS = ("-mprefer-vector-width=512",)
X86_FLAGS = ("-mprefer-vector-width=256",)


def _wide_vectors(processor: str) -> bool:
    """True for an AMD processor with AVX-512 (``processor``: :func:`_processor`'s text)."""
    return "AuthenticAMD" in processor and " avx512f" in processor


def compile_flags(identity: str, flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` with the ones every build takes, and GCC's own (``identity``: the compiler's ``--version``)."""
    gcc = "Free Software Foundation" in identity or "GCC" in identity
    x86 = platform.machine().lower() in ("x86_64", "amd64") and "-march=native" in flags
    width = (X86_WIDE_FLAGS if _wide_vectors(_processor()) else X86_FLAGS) if x86 else ()
    return (*flags, *COMMON_FLAGS, *(GCC_FLAGS if gcc else ()), *width)


def cache_key(cc: str, flags: tuple[str, ...]) -> str:
    """The hash naming one build: source, flags, compiler, processor, ABI and ropelib version."""
    from .. import __version__  # the package's version, read when a build is keyed (not at import)

    identity = _identity(cc)
    digest = hashlib.sha256()
    for part in (
        *(path.read_bytes() for path in SOURCES),
        " ".join(compile_flags(identity, flags)).encode(),
        identity.encode(),
        _processor().encode(),
        f"abi {ABI} ropelib {__version__} {sys.platform}".encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:24]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` between processes (``fcntl.flock``; no lock where there is none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        try:
            import fcntl
        except ImportError:  # not POSIX: concurrent builds each write a complete file, renamed atomically
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Library:
    """A loaded build: its entry points by dtype, where it is, and whether this process compiled it."""

    functions: dict[torch.dtype, Callable[[bytes], int]]
    path: Path
    compiled: bool


class BuildFailed(RuntimeError):
    """The native kernel could not be built or loaded here; the message holds the compiler's output."""


def _load(path: Path, compiled: bool) -> Library:
    """Load the library at ``path`` and check that it speaks :data:`ABI` with :class:`Call`'s layout."""
    handle = ctypes.CDLL(str(path))
    handle.ropelib_abi.restype = handle.ropelib_call_size.restype = ctypes.c_int64
    found = (handle.ropelib_abi(), handle.ropelib_call_size())
    if found != (ABI, ctypes.sizeof(Call)):
        raise BuildFailed(f"{path} has ABI {found}, expected {(ABI, ctypes.sizeof(Call))} (a stale or foreign file)")
    functions = {}
    for dtype, name in ENTRY_POINTS.items():
        function = getattr(handle, name)
        function.argtypes = [ctypes.c_char_p]  # the bytes of a PACKED_CALL (read-only in C)
        function.restype = ctypes.c_int64
        functions[dtype] = function
    return Library(functions, path, compiled)


def _compile(cc: str, folder: Path) -> Library:
    """Load the first of :data:`FLAGS` that is cached, or compile it (under the lock); :class:`BuildFailed` if none builds."""
    errors = []
    for flags in FLAGS:
        key = cache_key(cc, flags)
        target = folder / f"rotate-{key}.so"
        with _file_lock(folder / f"rotate-{key}.lock"):
            if target.exists():
                return _load(target, compiled=False)
            with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as work:
                partial = Path(work) / "rotate.so"
                command = [cc, *compile_flags(_identity(cc), flags), str(SOURCES[0]), "-o", str(partial)]
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if result.returncode == 0:
                    os.replace(partial, target)  # atomic: other processes see no file or the whole file
                    return _load(target, compiled=True)
                errors.append(f"$ {' '.join(command)}\n{result.stderr.strip()}")
    raise BuildFailed(f"{cc} could not compile {SOURCES[0].name}:\n" + "\n".join(errors))


class NativeBuild:
    """The state of a process's native library: not asked for, loaded, or failed (with why).

    One instance, :data:`ropelib.kernels.native_kernel.BUILD`: a library loaded into a process is
    process state. It holds no tensor and no module. ``verify(library)`` raises
    :class:`BuildFailed` when a freshly loaded library does not compute what it should.
    """

    def __init__(self, verify: Callable[[Library], None]) -> None:
        self._verify = verify
        self._lock = threading.Lock()
        self._library: Library | None = None
        self._failure: str | None = None
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        """In a forked child: a build the parent had under way has no thread here, so start afresh."""
        self._lock = threading.Lock()
        if self._library is None:
            self._failure = None

    def library(self) -> Library:
        """The loaded library, built or read from the cache on the first call (blocking); :class:`BuildFailed` otherwise."""
        library = self._library
        if library is not None:
            return library
        with self._lock:
            if self._library is None and self._failure is None:
                self._build()
            if self._library is None:
                raise BuildFailed(self._failure or "the native kernel is not available")
            return self._library

    def _build(self) -> None:
        cc = compiler()
        if os.environ.get(ENV, "1") == "0":
            self._failure = f"turned off by {ENV}=0"
            return
        if cc is None:
            self._failure = "no C compiler ($CC, cc, gcc or clang) was found"
            return
        try:
            library = _compile(cc, cache_dir())
            self._verify(library)
            self._library = library
        except (OSError, subprocess.SubprocessError, BuildFailed, AttributeError) as error:
            self._failure = str(error)
            LOG.warning("ropelib: the native CPU kernel is not available, the PyTorch kernel serves instead: %s", error)

    def available(self) -> bool:
        """True when the library is loaded or can be (this builds it, once, if needed)."""
        if self._library is not None:
            return True
        try:
            self.library()
        except BuildFailed:
            return False
        return True

    def status(self) -> str:
        """A line for ``python -m ropelib --check``: the cache folder and the state of the build."""
        if self._library is not None:
            how = "compiled by this process" if self._library.compiled else "loaded from the cache"
            return f"loaded ({how}): {self._library.path}"
        if self._failure is not None:
            return f"not available: {self._failure.splitlines()[0]}"
        return f"not built yet (cache folder {cache_dir()})"
