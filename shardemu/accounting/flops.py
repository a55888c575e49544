"""Analytic FLOP counts of transformer training, per operation, so counts compose.

Symbols: B sequences, s sequence length, T = B s tokens, d model width, f MLP width,
A heads, G key/value heads (grouped-query attention; G = A without), k = d / A head
width, V vocabulary, L layers. A gated MLP (SwiGLU: Llama) has two input matrices. A
mixture of experts of E experts routes each token to K of them: its router is a
[T, d] x [d, E] matmul, and its MLP matmuls are the K active experts' (Fedus et al.
2022, "Switch Transformers", Section 2: the FLOPs per token of K experts; the slots a
capacity factor over 1 leaves empty are executed, not model, FLOPs).

A matrix product [m, k] x [k, n] costs 2 m k n FLOPs (a multiply and an add per
multiply-accumulate); its backward pass costs twice that (gradients with respect to
both operands), so a training step without recomputation costs 3x the forward matmuls
(Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Section 2.1 and Table 1).
Elementwise work (LayerNorm, softmax, GELU, biases) is not counted: it is O(T d), small
next to O(T d^2) for real model widths, and XLA's count of it depends on fusion.

Cross-checks (tests/test_flops.py): for GPT with f = 4d, the sum below equals Narayanan
et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters", Section
5.1), 72 B s L d^2 (1 + s / (6 d) + V / (12 L d)) without recomputation; and it agrees
with XLA's `compiled.cost_analysis()["flops"]` of the real forward and backward pass
within 2%. XLA counts a while-loop body once, whatever its trip count, so a scanned
stack of L layers reports one layer: compare per layer, or multiply.
"""

from __future__ import annotations

from shardemu.config import ModelConfig
from shardemu.models import Model


def matmul(m: int, k: int, n: int) -> int:
    """FLOPs of [m, k] x [k, n]."""
    return 2 * m * k * n


def layer_forward(model: Model, batch: int, seq: int) -> dict[str, int]:
    """One transformer layer's forward matmuls, by operation."""
    cfg = model.cfg
    tokens, d, f = batch * seq, cfg.embed_dim, cfg.mlp_dim
    heads, k = cfg.num_heads, cfg.head_dim
    gated = model.family.gated_mlp
    routed = tokens * (cfg.experts_per_token if cfg.num_experts else 1)
    router = {"router": matmul(tokens, d, cfg.num_experts)} if cfg.num_experts else {}
    return {
        # A query heads and G key/value heads of k (G = A without grouping)
        "qkv": matmul(tokens, d, (heads + 2 * cfg.kv_heads) * k),
        "attn_scores": batch * heads * matmul(seq, k, seq),  # Q K^T, all s x s scores
        "attn_context": batch * heads * matmul(seq, seq, k),  # probs V
        "attn_out": matmul(tokens, d, d),
        **router,
        "mlp_in": (2 if gated else 1) * matmul(routed, d, f),  # SwiGLU: gate and up
        "mlp_out": matmul(routed, f, d),
    }


def head_forward(model: Model, batch: int, seq: int) -> dict[str, int]:
    """The output head's forward matmuls, as its family declares them
    (`Family.head_matmuls`: GPT's at every position, BERT's masked-LM head at its P
    masked positions a sequence)."""
    shapes = model.family.head_matmuls(model.cfg, batch, seq)
    return {name: matmul(m, k, n) for name, (m, k, n) in shapes.items()}


def forward(model: Model, batch: int, seq: int) -> int:
    """Forward FLOPs of the whole model on B sequences of length s."""
    layers = model.cfg.num_layers * sum(layer_forward(model, batch, seq).values())
    return layers + sum(head_forward(model, batch, seq).values())


def training_step(model: Model, batch: int, seq: int, recompute: bool = False) -> int:
    """Forward + backward FLOPs of one step (`model_flops`); with full recomputation the
    layers' forward runs twice (Narayanan et al. 2021: 4x instead of 3x forward)."""
    flops = 3 * forward(model, batch, seq)
    if recompute:
        flops += model.cfg.num_layers * sum(layer_forward(model, batch, seq).values())
    return flops


# FlashAttention-2's tile of queries and keys on an A100 or H100 at head width 128 (Dao
# 2023, "FlashAttention-2", section 3.1.1 and its kernels' 128 x 128 blocks)
ATTENTION_BLOCK = 128


def causal_fraction(model: Model, seq: int) -> float:
    """The share of the [s, s] scores a causal fused kernel computes: the blocks on and
    below the diagonal, (n + 1) / (2 n) of n x n (Dao 2023, "FlashAttention-2", section
    3.1.1: the blocks above it are skipped); 1 for a family whose attention is not causal
    (`Family.example_mask`: a mask per example)."""
    if model.family.example_mask:
        return 1.0
    n = -(-seq // ATTENTION_BLOCK)
    return (n + 1) / (2 * n)


def least_training_flops(model: Model, batch: int, seq: int) -> float:
    """What no training step computes less of: `training_step` less half of a causal
    model's attention core (Q K^T and probs V, forward and their two backward products),
    which a causal fused kernel skips at most (`causal_fraction` >= 1/2)."""
    skipped = 3 * model.cfg.num_layers * _causal_half(model, layer_forward(model, batch, seq))
    return training_step(model, batch, seq) - skipped


def least_layer_training_flops(
    model: Model, batch: int, seq: int, recompute: bool = False
) -> float:
    """One layer's share of `least_training_flops`: its forward matmuls, forward and
    backward (3 passes; 4 with full recomputation, `training_step`), each less what a
    causal fused kernel skips of its attention core."""
    core, passes = layer_forward(model, batch, seq), 4 if recompute else 3
    return passes * (sum(core.values()) - _causal_half(model, core))


def _causal_half(model: Model, core: dict[str, int]) -> float:
    """Half a layer's attention core in one pass (Q K^T and probs V), what a causal
    fused kernel skips at most; none where attention is not causal."""
    if model.family.example_mask:
        return 0.0
    return (core["attn_scores"] + core["attn_context"]) / 2


def without_zero_weights(model_flops: float, tokens: int, zero_weights: float) -> float:
    """`model_flops_sparse`: the model FLOPs less what zero weights would not cost in a
    sparse kernel, 2 FLOPs per weight per token in each of the forward, data-gradient and
    weight-gradient matmuls (all three scaled by density: Dietrich et al. 2021,
    "Towards structured dynamic sparse pre-training of BERT", appendix A.2)."""
    return model_flops - 6 * tokens * zero_weights


def narayanan_gpt(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Narayanan et al. 2021's closed form without recomputation (needs f = 4 d):
    72 B s L d^2 (1 + s / (6 d) + V / (12 L d))."""
    d, layers = cfg.embed_dim, cfg.num_layers
    return (
        72 * batch * seq * layers * d**2 * (1 + seq / (6 * d) + cfg.vocab_size / (12 * layers * d))
    )
