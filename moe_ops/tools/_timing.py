"""CUDA-graph capture shared by the benchmark and the tuner."""
from __future__ import annotations

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
