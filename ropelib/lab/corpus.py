"""A real corpus with nothing to download: a fixed list of Python's own standard-library sources.

The text is the bytes of :data:`MODULES` (``<name>.py`` under ``sysconfig.get_paths()["stdlib"]``),
read as bytes (a byte-level vocabulary of 256). Modules that rarely change between patch releases
were chosen, so that the corpus is the same on most Pythons of a minor version; it is identified by
the sha256 of the bytes used (:func:`corpus_hash`), which a record stores with the Python version.
A listed module missing from the running Python is skipped and reported (``missing``).

The split is by file, never inside one: a file goes to ``test`` when the first byte of the sha256
of its name (``"abc.py"``) is ``< 26`` (about 10%), to ``validation`` when it is ``< 52``, else to
``train``. It depends on the names only, so it is the same on every Python.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from .._validation import check_choice, check_int

#: The modules of the corpus (top-level ``.py`` files of the standard library), in the order they are joined.
MODULES = (
    "abc", "argparse", "bisect", "calendar", "cmd", "code", "codeop", "colorsys", "copy", "copyreg",
    "csv", "dataclasses", "difflib", "enum", "filecmp", "fileinput", "fnmatch", "fractions",
    "functools", "getopt", "gettext", "glob", "heapq", "keyword", "linecache", "netrc", "numbers",
    "operator", "optparse", "pprint", "queue", "quopri", "random", "reprlib", "sched", "secrets",
    "shelve", "shlex", "statistics", "string", "stringprep", "struct", "symtable", "tabnanny",
    "textwrap", "timeit", "token", "wave", "weakref", "zipapp",
)  # fmt: skip
SPLITS = ("train", "validation", "test")
VOCAB_SIZE = 256
SPLIT_RULE = "sha256(file name)[0] < 26: test; < 52: validation; else train"


def split_of(name: str) -> str:
    """The split of a file by its name (see the module docstring).

    Example:
        >>> split_of("abc.py") in SPLITS
        True
    """
    first = hashlib.sha256(name.encode("utf-8")).digest()[0]
    return "test" if first < 26 else "validation" if first < 52 else "train"


def stdlib_dir() -> Path:
    """The standard library's directory of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Corpus:
    """The corpus's bytes per split (uint8 tensors) and what identifies them.

    ``files`` maps each split to its file names (in :data:`MODULES` order); ``file_sha256`` each
    file to the sha256 of its bytes; ``missing`` lists the modules the running Python lacks.
    """

    splits: dict[str, torch.Tensor]
    files: dict[str, list[str]]
    file_sha256: dict[str, str]
    missing: list[str]

    @property
    def sha256(self) -> str:
        """:func:`corpus_hash` of the files used."""
        return corpus_hash(self.file_sha256)

    def summary(self) -> dict[str, object]:
        """What a record stores: hash, sizes in bytes and files per split, the split rule, missing files."""
        return {
            "source": "Python standard library sources (ropelib.lab.corpus.MODULES)",
            "sha256": self.sha256,
            "bytes": {s: int(t.numel()) for s, t in self.splits.items()},
            "files": self.files,
            "file_sha256": self.file_sha256,
            "missing": self.missing,
            "split_rule": SPLIT_RULE,
            "vocab_size": VOCAB_SIZE,
        }


def corpus_hash(file_sha256: dict[str, str]) -> str:
    """sha256 over ``name:sha256`` lines of every file used, in :data:`MODULES` order (order-independent input).

    Example:
        >>> corpus_hash({"b.py": "2", "a.py": "1"}) == corpus_hash({"a.py": "1", "b.py": "2"})
        True
    """
    order = {f"{m}.py": i for i, m in enumerate(MODULES)}
    names = sorted(file_sha256, key=lambda n: (order.get(n, len(order)), n))
    return hashlib.sha256("".join(f"{n}:{file_sha256[n]}\n" for n in names).encode()).hexdigest()


def load_corpus(directory: str | Path | None = None) -> Corpus:
    """Read :data:`MODULES` from ``directory`` (default :func:`stdlib_dir`) and split them by file."""
    root = stdlib_dir() if directory is None else Path(directory)
    if not root.is_dir():
        raise ValueError(f"directory must be a directory, got {str(root)!r}")
    chunks: dict[str, list[bytes]] = {s: [] for s in SPLITS}
    files: dict[str, list[str]] = {s: [] for s in SPLITS}
    hashes, missing = {}, []
    for module in MODULES:
        name = f"{module}.py"
        path = root / name
        if not path.is_file():
            missing.append(name)
            continue
        data = path.read_bytes()
        hashes[name] = hashlib.sha256(data).hexdigest()
        split = split_of(name)
        chunks[split].append(data)
        files[split].append(name)
    splits = {s: torch.frombuffer(bytearray(b"".join(c)), dtype=torch.uint8).clone() for s, c in chunks.items()}
    for s, t in splits.items():
        if t.numel() == 0:
            raise ValueError(f"the {s} split of the corpus in {str(root)!r} is empty")
    return Corpus(splits, files, hashes, missing)


def windows(data: torch.Tensor, length: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` random windows of ``length + 1`` bytes from ``data`` (int64 ``[count, length + 1]``).

    Inputs are ``w[:, :-1]``, next-byte targets ``w[:, 1:]``.
    """
    length = check_int(length, "length", minimum=1)
    count = check_int(count, "count", minimum=1)
    if data.ndim != 1 or data.numel() < length + 1:
        raise ValueError(f"data must be 1-D with more than length={length} bytes, got shape {tuple(data.shape)}")
    starts = torch.randint(0, data.numel() - length, (count,), generator=generator)
    return data[starts[:, None] + torch.arange(length + 1)].long()


def split_bytes(corpus: Corpus, split: str) -> torch.Tensor:
    """The bytes of one split."""
    return corpus.splits[check_choice(split, "split", SPLITS)]


def decode(data: torch.Tensor) -> str:
    """Bytes (any integer tensor with values in ``0..255``) as text, undecodable bytes replaced."""
    return bytes(data.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
