"""``python -m ropelib.bench``."""

from .cli import main

main()
