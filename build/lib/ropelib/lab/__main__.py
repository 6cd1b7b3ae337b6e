"""``python -m ropelib.lab``."""

from .experiment import main

main()
