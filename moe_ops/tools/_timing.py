"""CUDA-graph capture shared by the benchmark and the tuner; a GPU noise process and a poisoned
allocator for the repeatability probe and the GPU tests."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Callable

import torch


def capture_graph(fn: Callable[[], torch.Tensor]):
    """(graph, its output tensor): `fn` warmed up on a side stream, then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def poison_cuda_allocator(nbytes: int = 1 << 30) -> None:
    """Fill free cached CUDA memory with NaN so that intermediates the kernels never write show
    up in the next call's outputs."""
    torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))


def start_gpu_noise():
    """A process running bf16 matmuls on the same GPU, returned once it is running (the
    failure mode of Triton 3.6's warp-specialised kernels appeared only beside one)."""
    code = ("import time, torch\n"
            "a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
            "print('ready', flush=True)\n"
            "t = time.time()\n"
            "while time.time() - t < 3600:\n"
            "    a @ a\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"the GPU noise process did not start: {line!r}")
    return proc


@contextlib.contextmanager
def gpu_noise(enabled: bool = True):
    """A start_gpu_noise process for the block (none where not enabled), ended after it."""
    proc = start_gpu_noise() if enabled else None
    try:
        yield proc
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
