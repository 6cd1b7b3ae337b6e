"""The extrapolation lab (``python -m ropelib.lab``): a tool on top of the library, never imported by it.

See :mod:`ropelib.lab.experiment` for the experiment and its command line.
"""

from .experiment import (
    ENCODINGS,
    EVAL_SEED,
    IGNORE,
    LARGE,
    SMALL,
    TEST_TIME_SCALINGS,
    LabConfig,
    TinyTransformer,
    accuracy,
    format_table,
    main,
    provenance,
    repeat_batch,
    run,
    scaling_for_length,
    train,
    with_rope_scaling,
)

__all__ = [
    "ENCODINGS",
    "EVAL_SEED",
    "IGNORE",
    "LARGE",
    "SMALL",
    "TEST_TIME_SCALINGS",
    "LabConfig",
    "TinyTransformer",
    "accuracy",
    "format_table",
    "main",
    "provenance",
    "repeat_batch",
    "run",
    "scaling_for_length",
    "train",
    "with_rope_scaling",
]
