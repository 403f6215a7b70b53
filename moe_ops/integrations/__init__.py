"""Integrations of moe_ops with other libraries.

`moe_ops.integrations.huggingface`: HuggingFace transformers (`apply_moe_ops`, `revert_moe_ops`, the
`"moe_ops"` experts implementation). Import it explicitly; it needs transformers installed."""
