"""Tuned dispatch configurations per device: JSON tables written by `moe-ops-tune`,
looked up by problem shape with the nearest measured token count; the heuristic in
`moe_ops.tuning.heuristics` is the fallback when a device or shape has no table.

Where: one file per device, <device name>.json (characters other than letters, digits, "-" and
"." replaced by underscores). `moe-ops-tune` writes to $MOE_OPS_TUNING_DIR when set,
else to the user's cache ($XDG_CACHE_HOME or ~/.cache, then moe_ops/tuning), never into the
installed package. Lookup reads $MOE_OPS_TUNING_DIR alone when it is set; else the user's
table, then one shipped in the package (moe_ops/tuning/configs; none ships today).
Format (version 2):
{"version": 2, "device": "NVIDIA H200", "triton": "3.6.0",
 "entries": [{"H": 2048, "I": 768, "E": 128, "K": 8, "dtype": "bfloat16",
              "configs": {"1": {<DispatchConfig fields>}, "512": {...}}},
             {"H": 2880, "I": 2880, "E": 32, "K": 4, "dtype": "bfloat16",
              "weights": "mxfp4-mma", "block_shape": null,
              "configs": {"1": {<QuantDispatchConfig fields>}, ...}}]}
An entry without "weights" is the unquantized experts' (DispatchConfig); one with it is the
quantized experts' of that format (QuantDispatchConfig; "weights" one of QUANT_WEIGHTS, FP8
entries with their [bn, bk] "block_shape"). Tables written before quantized entries existed
read unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path

import torch

from moe_ops import _env
from moe_ops.tuning.configs import DispatchConfig, QuantDispatchConfig

# 2: DispatchConfig's descriptive field names (version-1 tables are refused with a message to
# re-run moe-ops-tune)
FORMAT_VERSION = 2
_generation = 0   # tables written in this process (part of the memoised configs' keys)
# the "weights" of quantized entries (moe-ops-bench's --weights values; heuristics.
# quant_weights_name)
QUANT_WEIGHTS = ("fp8", "fp8-w8a16", "mxfp4", "mxfp4-mma")


def generation() -> int:
    return _generation
_PACKAGE_DIR = Path(__file__).resolve().parent / "configs"


def user_dir() -> Path | None:
    """The default directory tables are written to and read from first (outside the package:
    a pip-installed site-packages may be read-only, and pip would not remove the file). None
    when there is no home directory to put it in (then only MOE_OPS_TUNING_DIR and the
    package's tables exist)."""
    cache = _env.xdg_cache_home()
    if not cache:
        try:
            cache = Path.home() / ".cache"
        except RuntimeError:   # no HOME and no passwd entry (some containers)
            return None
    return Path(cache) / "moe_ops" / "tuning"


def _file_name(device_name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in device_name) + ".json"


def table_path(device_name: str, directory: str | os.PathLike | None = None) -> Path:
    """Where the device's table is written: `directory`, else $MOE_OPS_TUNING_DIR, else
    `user_dir()`."""
    base = directory or _env.tuning_dir() or user_dir()
    if base is None:
        raise RuntimeError("no home directory for the tuned tables: set MOE_OPS_TUNING_DIR or "
                           "pass a directory (moe-ops-tune --out-dir)")
    return Path(base) / _file_name(device_name)


def find_table(device_name: str, directory: str | os.PathLike | None = None) -> Path | None:
    """The table lookup reads: in `directory` or $MOE_OPS_TUNING_DIR when given (only there),
    else the user's, else the package's; None when there is none."""
    explicit = directory or _env.tuning_dir()
    bases = [Path(explicit)] if explicit else [user_dir(), _PACKAGE_DIR]
    for base in filter(None, bases):
        path = base / _file_name(device_name)
        if path.is_file():
            return path
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_to_dict(cfg: DispatchConfig | QuantDispatchConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict, cls=DispatchConfig):
    """A `cls` config (DispatchConfig, or QuantDispatchConfig for quantized entries) from a
    table's fields."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields in tuned table: {sorted(unknown)}")
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = required - set(d)
    if missing:
        raise ValueError(f"{cls.__name__} fields missing in tuned table: {sorted(missing)}")
    return cls(**d)


def _entry_class(entry: dict):
    weights = entry.get("weights")
    if weights is None:
        return DispatchConfig
    if weights not in QUANT_WEIGHTS:
        raise ValueError(f"tuned table entry: weights must be one of {list(QUANT_WEIGHTS)}, got "
                         f"{weights!r}")
    bs = entry.get("block_shape")
    if weights.startswith("fp8"):
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(v, int) for v in bs)):
            raise ValueError(f"tuned table entry: an FP8 entry needs block_shape [bn, bk], got "
                             f"{bs!r}")
    elif bs is not None:
        raise ValueError(f"tuned table entry: an MXFP4 entry has block_shape null, got {bs!r}")
    return QuantDispatchConfig


def _entry_key(entry: dict) -> tuple:
    bs = entry.get("block_shape")
    return (entry["H"], entry["I"], entry["E"], entry["K"], entry["dtype"],
            entry.get("weights"), tuple(bs) if bs is not None else None)


def validate_table(table: dict) -> None:
    if table.get("version") != FORMAT_VERSION:
        raise ValueError(f"tuned table version must be {FORMAT_VERSION}, got {table.get('version')!r}")
    for entry in table.get("entries", []):
        for key in ("H", "I", "E", "K", "dtype", "configs"):
            if key not in entry:
                raise ValueError(f"tuned table entry lacks {key!r}: {entry}")
        cls = _entry_class(entry)
        for t, cfg in entry["configs"].items():
            int(t)
            config_from_dict(cfg, cls)


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict | None:
    p = Path(path)
    if not p.is_file():
        return None
    # A table that does not parse would otherwise fail every moe.dispatch on this GPU with a
    # bare JSONDecodeError / KeyError that names neither the file nor what to do.
    try:
        table = json.loads(p.read_text())
        if not isinstance(table, dict):
            raise ValueError(f"expected a JSON object, got {type(table).__name__}")
        validate_table(table)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"moe_ops: the tuned table {p} is not a valid version-{FORMAT_VERSION} "
                         f"table ({type(e).__name__}: {e}); delete it or re-run "
                         "moe-ops-tune to write a new one") from e
    return table


def lookup(T: int, E: int, K: int, H: int, I: int, dtype: torch.dtype, device_name: str,
           directory=None, weights: str | None = None, block_shape=None):
    """The tuned config of the entry matching (H, I, E, K, dtype) and the weight format
    (`weights`: None for unquantized experts, else one of QUANT_WEIGHTS with FP8's
    `block_shape` [bn, bk]) at the measured token count nearest to T (in log space), or None."""
    # (runs once per shape: the heuristics module memoises the answer)
    path = find_table(device_name, directory)
    table = _load(str(path)) if path is not None else None
    if table is None:
        return None
    key = (H, I, E, K, _dtype_name(dtype), weights,
           tuple(block_shape) if block_shape is not None else None)
    for entry in table["entries"]:
        if _entry_key(entry) == key:
            measured = sorted(int(t) for t in entry["configs"])
            if not measured:
                return None
            best = min(measured, key=lambda t: abs(math.log(max(t, 1)) - math.log(max(T, 1))))
            return config_from_dict(entry["configs"][str(best)], _entry_class(entry))
    return None


def read_table(device_name: str, directory=None) -> dict | None:
    """The device's table where table_path puts it, validated; None where there
    is none. A broken one raises the ValueError of _load."""
    return _load(str(table_path(device_name, directory)))


def write_table(device_name: str, entries: list[dict], directory=None, triton_version=None) -> Path:
    """Merges `entries` into the device's table (same shape, dtype and weight format: token
    counts updated)."""
    path = table_path(device_name, directory)
    table = read_table(device_name, directory)
    table = json.loads(json.dumps(table)) if table else {
        "version": FORMAT_VERSION, "device": device_name, "triton": triton_version, "entries": []}
    for new in entries:
        key = _entry_key(new)
        for old in table["entries"]:
            if _entry_key(old) == key:
                old["configs"].update(new["configs"])
                break
        else:
            table["entries"].append(new)
    if triton_version:
        table["triton"] = triton_version
    validate_table(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    global _generation
    _load.cache_clear()
    _generation += 1   # memoised configs (heuristics.dispatch_config) look again
    return path
