"""The `disco-ray` command line: the parser (`main`) and one module per command."""

from .app import main

__all__ = ["main"]
