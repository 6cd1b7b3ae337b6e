"""``python -m ropelib.lab``: the synthetic lab (:mod:`~ropelib.lab.experiment`), or with ``--text`` the lab on real text (:mod:`~ropelib.lab.text`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from . import experiment, text


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the lab that the arguments name (``--text``: the lab on text, which parses its own options); returns its record."""
    words = sys.argv[1:] if argv is None else list(argv)
    if "--text" in words:
        return text.main(words)
    return experiment.main(argv)
