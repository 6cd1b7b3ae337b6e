"""The benchmark tool (``python -m ropelib.bench``): never imported by the library.

* :mod:`~ropelib.bench.harness`: interleaved timing;
* :mod:`~ropelib.bench.rope`: the implementations and one configuration's run, with its copy and clone roofs;
* :mod:`~ropelib.bench.decode`: decode-shape calls and a model step with a KV cache;
* :mod:`~ropelib.bench.bias`: relative-bias attention, materialized against ``flex_attention``;
* :mod:`~ropelib.bench.cli`: the command line.
"""

from .cli import QUICK_SHAPE, build_parser, environment, format_table, main, parse_shape
from .harness import synchronize, time_interleaved
from .rope import (
    CLONE_ROOF,
    COPY_ROOF,
    CPU_SHAPE,
    DTYPES,
    GPU_SHAPE,
    IMPL_NAMES,
    MODES,
    ROOFS,
    Result,
    implementations,
    rope_bytes,
    run_config,
)

__all__ = [
    "CLONE_ROOF",
    "COPY_ROOF",
    "CPU_SHAPE",
    "DTYPES",
    "GPU_SHAPE",
    "IMPL_NAMES",
    "MODES",
    "QUICK_SHAPE",
    "ROOFS",
    "Result",
    "build_parser",
    "environment",
    "format_table",
    "implementations",
    "main",
    "parse_shape",
    "rope_bytes",
    "run_config",
    "synchronize",
    "time_interleaved",
]
