"""Runtimes: where plans and pipeline programs run (this process, or Ray host actors)."""

from jaxreshard.runtime._api import current_runtime as current_runtime
from jaxreshard.runtime._api import running_runtime as running_runtime

__all__ = ["current_runtime", "running_runtime"]
