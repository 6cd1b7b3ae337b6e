"""``python -m ropelib.lab`` (``--text``: the lab on real text, :mod:`ropelib.lab.text`)."""

from .cli import main

main()
