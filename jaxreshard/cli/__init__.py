"""The `jaxreshard` command line (`python -m jaxreshard` or the `jaxreshard` script).

One module per command (`_bench.py`, `_schedule.py`, `_profile.py`, `_cluster.py`), the parser
and the error path in `_main.py`, and what they share (console, outputs, argument types, error
messages) in `_console.py`.
"""

from jaxreshard.cli._main import build_parser as build_parser
from jaxreshard.cli._main import main as main

__all__ = ["build_parser", "main"]
