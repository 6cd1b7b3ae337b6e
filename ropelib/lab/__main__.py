"""``python -m ropelib.lab`` (``--text``: the lab on real text, :mod:`ropelib.lab.text`)."""

import sys

if "--text" in sys.argv[1:]:
    from .text import main as text_main

    text_main()
else:
    from .experiment import main

    main()
