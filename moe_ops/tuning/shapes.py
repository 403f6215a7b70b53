"""Named MoE problem shapes (the benchmark's): name -> (H, I, E, K)."""
SHAPES = {
    "mixtral_8x7b": (4096, 14336, 8, 2),
    "qwen3_30b_a3b": (2048, 768, 128, 8),
    "deepseek_v3_routed": (7168, 2048, 256, 8),
    "olmoe": (2048, 1024, 64, 8),
}
