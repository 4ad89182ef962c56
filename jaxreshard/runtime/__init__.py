"""Runtimes: where plans and pipeline programs run (this process, or Ray host actors)."""
