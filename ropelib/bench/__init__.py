"""The benchmark tool (``python -m ropelib.bench``): never imported by the library.

* :mod:`~ropelib.bench.harness`: interleaved timing;
* :mod:`~ropelib.bench.rope`: the implementations and one configuration's run, with its true roofs;
* :mod:`~ropelib.bench.decode`: decode-shape calls and a model step with a KV cache;
* :mod:`~ropelib.bench.bias`: relative-bias attention, materialized against ``flex_attention``;
* :mod:`~ropelib.bench.cli`: the command line.
"""

from .cli import QUICK_SHAPE, build_parser, environment, format_table, main, parse_shape
from .harness import synchronize, time_interleaved
from .rope import (
    CPU_SHAPE,
    DTYPES,
    FRESH_ROOF,
    GPU_SHAPE,
    IMPL_NAMES,
    INPLACE_ROOF,
    MODES,
    PREFILL_SHAPE,
    ROOFS,
    Result,
    implementations,
    roof_of,
    rope_bytes,
    run_config,
)

__all__ = [
    "CPU_SHAPE",
    "DTYPES",
    "FRESH_ROOF",
    "GPU_SHAPE",
    "IMPL_NAMES",
    "INPLACE_ROOF",
    "MODES",
    "PREFILL_SHAPE",
    "QUICK_SHAPE",
    "ROOFS",
    "Result",
    "build_parser",
    "environment",
    "format_table",
    "implementations",
    "main",
    "parse_shape",
    "roof_of",
    "rope_bytes",
    "run_config",
    "synchronize",
    "time_interleaved",
]
