"""Command-line pieces that :mod:`tilefuse.cli` and the modules it runs share (``python -m
tilefuse.bench.corpus``, ``tilefuse stress``'s options): argparse value types and a stdout that
survives a closed pipe. Imports nothing of tilefuse, so any layer may use it without importing
the command line itself."""

from __future__ import annotations

import argparse
import math
import os


class ClosedPipeSafe:
    """``sys.stdout`` for the command: once its reader has gone (``tilefuse info | head -3``), the
    rest of the output goes to os.devnull instead of raising BrokenPipeError, so the command ends
    as it would have (a benchmark still writes its results files)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)
        try:
            self._stream.flush()          # what was buffered for the closed pipe goes to devnull
        except OSError:
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(positive_int(part) for part in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected positive whole numbers separated by commas, got {text!r}") from None
    return values


def tag_name(text: str) -> str:
    if not any(c.isalnum() for c in text):
        raise argparse.ArgumentTypeError(f"expected letters or digits (it goes into file names), got {text!r}")
    return text
