"""Argument checks shared by the command-line tools (moe-ops-bench, moe-ops-tune,
moe_ops.tools.compile_check): a bad argument ends in argparse's usage error naming it, not in a
traceback from deep inside a run."""
from __future__ import annotations

import argparse
import os

import torch


def token_count(text: str) -> int:
    """argparse type of a token count: an int >= 1 (T = 0 is valid for the ops, but there is
    nothing to time or tune)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a token count must be >= 1, got {value}")
    return value


def device(parser: argparse.ArgumentParser, name: str | None, flag: str = "--device",
           default: str | None = None) -> torch.device:
    """torch.device(name or default or (cuda if available else cpu)), or parser.error naming
    the flag when the string is not a device or names a CUDA device this machine lacks."""
    name = name or default or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        parser.error(f"{flag} {name}: not a device ({exc})")
    if dev.type not in ("cpu", "cuda"):
        parser.error(f"{flag} {name}: moe_ops runs on cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"{flag} {name}: no CUDA device here (torch.cuda.is_available() is "
                         f"False; torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            parser.error(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA "
                         "device(s)")
    return dev


def output_file(parser: argparse.ArgumentParser, flag: str, path: str | None,
                suffixes: tuple[str, ...] | None = None) -> None:
    """Refuse, before a run of minutes or hours, an output file that could not be written at
    its end: a missing parent directory, a path that is a directory, or (`suffixes`) a suffix
    the writer does not know."""
    if not path:
        return
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: is a directory (give a file path)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        parser.error(f"{flag} {path}: no such directory")
    if suffixes is not None:
        ext = os.path.splitext(path)[1].lstrip(".").lower()
        if ext not in suffixes:
            parser.error(f"{flag} {path}: the file type must be one of {', '.join(suffixes)}")


def output_dir(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """An output directory: absent (it is created) or a directory, never an existing file."""
    if path and os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"{flag} {path}: exists and is not a directory")


def positive(parser: argparse.ArgumentParser, opts, *names: str) -> None:
    """Each named option (attribute names) None or > 0."""
    for name in names:
        v = getattr(opts, name)
        if v is not None and v <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
