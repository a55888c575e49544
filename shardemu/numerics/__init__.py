"""Numerics: precision policies (fp32, bf16, fp16 with loss scaling) and optimizers."""
