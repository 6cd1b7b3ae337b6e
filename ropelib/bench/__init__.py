"""The benchmark tool (``python -m ropelib.bench``): never imported by the library.

* :mod:`~ropelib.bench.harness`: interleaved timing, the copy and clone roofs;
* :mod:`~ropelib.bench.rope`: the implementations and one configuration's run;
* :mod:`~ropelib.bench.decode`: decode-shape calls and a model step with a KV cache;
* :mod:`~ropelib.bench.bias`: relative-bias attention, materialized against ``flex_attention``;
* :mod:`~ropelib.bench.cli`: the command line.
"""

from .cli import QUICK_SHAPE, build_parser, environment, format_table, main, parse_shape
from .harness import clone_fn, copy_fn, synchronize, time_interleaved
from .rope import CPU_SHAPE, DTYPES, GPU_SHAPE, IMPL_NAMES, MODES, Result, implementations, rope_bytes, run_config

__all__ = [
    "CPU_SHAPE",
    "DTYPES",
    "GPU_SHAPE",
    "IMPL_NAMES",
    "MODES",
    "QUICK_SHAPE",
    "Result",
    "build_parser",
    "clone_fn",
    "copy_fn",
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
