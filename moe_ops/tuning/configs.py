"""Kernel configurations (keyword-only, frozen dataclasses) and the one API through which
experiments and tools constrain them.

Every launcher takes its config as an argument; the heuristics (moe_ops.tuning.heuristics) and
tuned tables (moe_ops.tuning.tables) produce them from shapes alone. To try other values without
editing code, constrain the fields (as triton_kernels' update_opt_flags_constraints does):

    from moe_ops.tuning import DispatchConfig, config_constraints
    with config_constraints(DispatchConfig, dependent_launch=False):
        out = moe_ops.dispatch(...)

Constraints apply to every config of that class the heuristics or tables return (nested ones
included) until reset; a config passed explicitly to a launcher is used as given."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DispatchConfig:
    """The forward of moe.dispatch (moe_ops.launch.dispatch)."""
    block_m: int                 # rows per row block of the alignment (tokens of one expert)
    gate_up_block_n: int         # gate+up GEMM: columns of I per program
    gate_up_block_k: int         # gate+up GEMM: reduction step over H
    down_block_n: int            # down GEMM: columns of H per program
    down_block_k: int            # down GEMM: reduction step over I
    num_warps: int
    num_stages: int
    group_m: int = 8             # row blocks that walk the column tiles together (L2 reuse)
    tma_weights: bool = False    # weight tiles through tensor descriptors (where the layout allows)
    direct_rows: bool = False    # few slots: slot s is row block s, no alignment launch
    down_combine_fused: bool = False   # T == 1, direct rows: down GEMM and combine in one kernel
    dependent_launch: bool = False     # programmatic dependent launch of the kernels (sm_90+)
    tma_gate_up_pair: bool = False     # with tma_weights: gate and up tiles in one copy
    half_height_tails: bool = False    # tail row blocks (<= block_m/2 valid rows) on half tiles
    combine_in_down: bool = False      # T == 1, direct rows: the down kernel's last program combines
    tma_down_activations: bool = False  # down GEMM: the activation tiles through TMA too


@dataclass(frozen=True, kw_only=True)
class RowGemmConfig:
    """A backward row GEMM: dA = dO W2_e (columns of I) or dx = dz W13_e (columns of H)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma_activations: bool = False   # the gathered A rows through tensor descriptors


@dataclass(frozen=True, kw_only=True)
class WeightGradConfig:
    """The weight gradients dW13_e and dW2_e (sums over each expert's rows)."""
    block_m: int                 # output tile rows
    block_n: int                 # output tile columns
    block_k: int                 # expert rows per step
    num_warps: int
    num_stages: int
    persistent: bool = False     # one program per SM walking output tiles (16-bit, sm_90+)
    persistent_num_stages: int = 0   # pipeline stages of the persistent loop (0: num_stages)
    persistent_chunk: int = 32   # persistent: output tiles per bookkeeping chunk (2^n, <= 32)
    lpt_schedule: bool = False   # persistent: largest experts' tiles first where routing is skewed


@dataclass(frozen=True, kw_only=True)
class ActivationGradConfig:
    """The elementwise pass from dA and z to dz, s*a and d topk_weights."""
    rows_per_program: int = 4
    block_i: int = 256           # columns of I per step


@dataclass(frozen=True, kw_only=True)
class BackwardConfig:
    """The backward of moe.dispatch (moe_ops.launch.dispatch_backward); its row block is the
    forward config's block_m (the backward walks the same alignment)."""
    activation_grad_gemm: RowGemmConfig   # dA = dO W2_e
    input_grad_gemm: RowGemmConfig        # dx = dz W13_e
    weight_grad: WeightGradConfig
    activation_grad: ActivationGradConfig = ActivationGradConfig()
    # dW13 in column chunks of H (x gathered one chunk at a time), so that its stage holds
    # x/x_chunks instead of all of x gathered: the same sums, less peak memory. 1: one chunk;
    # 0 (default): automatic (moe_ops.launch.dispatch_backward.x_chunks: two where gathered x
    # is more than half of dz)
    x_chunks: int = 0


@dataclass(frozen=True, kw_only=True)
class AlignmentConfig:
    """The alignment kernels (moe_ops.launch.alignment)."""
    tile_elems: int = 8192       # count/place programs walk [CHUNK, E] one-hot tiles of ~this size
    scan_elems: int = 16384      # at most scan_elems / E two-launch programs (one histogram tile)
    scan_warps: int = 4          # warps of the one-launch scan
    # three launches (count, column scan, place) where two-launch programs would walk at least
    # this many chunks each (docs/design.md, alignment: Qwen3-30B-A3B T=8192 58 -> 32 us)
    columns_min_chunks: int = 2
    max_column_programs: int = 4096
    column_scan_block: int = 1024
    # two-launch place: in-chunk ranks by a triangular compare where CHUNK <= this (10-20% faster
    # there than the cumulative sum)
    triangular_rank: bool = True
    triangular_max_chunk: int = 128


CONFIG_CLASSES = (DispatchConfig, RowGemmConfig, WeightGradConfig, ActivationGradConfig,
                  BackwardConfig, AlignmentConfig)

_constraints: dict = {}   # config class -> {field: value}
_generation = 0           # bumped on every change (part of the memoised configs' keys)


def update_config_constraints(cls, **fields) -> None:
    """From now on, every `cls` config the heuristics or tables return has these field values."""
    global _generation
    if cls not in CONFIG_CLASSES:
        raise TypeError(f"update_config_constraints: {cls!r} is not a moe_ops config class "
                        f"({', '.join(c.__name__ for c in CONFIG_CLASSES)})")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"update_config_constraints: {cls.__name__} has no field(s) {unknown}; "
                         f"its fields: {sorted(names)}")
    _constraints[cls] = {**_constraints.get(cls, {}), **fields}
    _generation += 1


def reset_config_constraints(cls=None) -> None:
    """Drop the constraints of `cls` (None: of every class)."""
    global _generation
    if cls is None:
        _constraints.clear()
    else:
        _constraints.pop(cls, None)
    _generation += 1


@contextlib.contextmanager
def config_constraints(cls, **fields):
    """update_config_constraints for the duration of a with block (the previous constraints of
    `cls` are restored after it)."""
    global _generation
    saved = dict(_constraints.get(cls, {}))
    update_config_constraints(cls, **fields)
    try:
        yield
    finally:
        if saved:
            _constraints[cls] = saved
        else:
            _constraints.pop(cls, None)
        _generation += 1


def constraints_generation() -> int:
    """Changes with every constraint update (memoised configs include it in their key)."""
    return _generation


def constrain(cfg):
    """`cfg` with the constrained fields of its class (and of nested configs) replaced."""
    if not _constraints:
        return cfg
    updates = dict(_constraints.get(type(cfg), {}))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name not in updates and type(value) in CONFIG_CLASSES:
            nested = constrain(value)
            if nested is not value:
                updates[f.name] = nested
    return dataclasses.replace(cfg, **updates) if updates else cfg
