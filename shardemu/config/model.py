"""`ModelConfig`: a model's sizes; presets live with their families (`models/`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardemu.config.checks import require_finite, require_positive
from shardemu.errors import ConfigError

# BERT masks 15% of a sequence's tokens for prediction (Devlin et al. 2019, Section 3.1)
MASKED_LM_PROB = 0.15


@dataclass(frozen=True)
class ModelConfig:
    """Transformer dimensions. Symbols: L layers, d embed, A heads, d_ff mlp, V vocab."""

    name: str
    family: str  # a registered family (models/family.py), checked when a Model is built
    vocab_size: int
    num_layers: int
    embed_dim: int
    num_heads: int
    mlp_dim: int
    max_positions: int
    type_vocab_size: int = 2  # BERT segment types; unused by GPT
    layer_norm_eps: float = 1e-5
    gelu_approximate: bool = True  # GPT-2 uses the tanh form; BERT the exact erf form
    init_std: float = 0.02
    param_dtype: str = "float32"
    # the layers' matmuls on FP8 operands (`models/fp8.py`; set by `--precision fp8`)
    fp8_matmuls: bool = False
    # BERT: positions per sequence its masked-LM head predicts (`predictions`); 0: 15%
    max_predictions: int = 0
    # key/value heads of grouped-query attention (Ainslie et al. 2023); 0: num_heads
    num_kv_heads: int = 0
    rope_theta: float = 10000.0  # the base of rotary position embeddings (Su et al. 2021)
    # a mixture of experts (models/moe.py): experts per layer (0: a dense MLP), the
    # experts each token is routed to (top-k), the capacity factor (an expert takes
    # ceil(k s factor / E) tokens of a sequence, the rest are dropped; 0: dropless, s),
    # and the weight of the load-balancing loss
    num_experts: int = 0
    experts_per_token: int = 0
    capacity_factor: float = 1.0
    router_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        require_positive(
            "ModelConfig",
            vocab_size=self.vocab_size,
            num_layers=self.num_layers,
            embed_dim=self.embed_dim,
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
            max_positions=self.max_positions,
            type_vocab_size=self.type_vocab_size,
        )
        require_finite(
            "ModelConfig", True, layer_norm_eps=self.layer_norm_eps, init_std=self.init_std
        )
        if not isinstance(self.max_predictions, int) or self.max_predictions < 0:
            raise ConfigError(
                f"ModelConfig.max_predictions must be a whole number of positions (0 for "
                f"15% of the sequence), got {self.max_predictions!r}"
            )
        if not isinstance(self.num_kv_heads, int) or self.num_kv_heads < 0:
            raise ConfigError(
                f"ModelConfig.num_kv_heads must be a whole number of heads (0: num_heads), "
                f"got {self.num_kv_heads!r}"
            )
        if self.num_heads % self.kv_heads:
            raise ConfigError(
                f"ModelConfig.num_kv_heads={self.num_kv_heads} does not divide "
                f"num_heads={self.num_heads}; each key/value head serves an equal group"
            )
        require_finite("ModelConfig", True, rope_theta=self.rope_theta)
        self._check_experts()
        if self.embed_dim % self.num_heads:
            raise ConfigError(
                f"ModelConfig.embed_dim={self.embed_dim} is not divisible by "
                f"num_heads={self.num_heads}; pick heads that divide the embedding width"
            )
        if self.param_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"ModelConfig.param_dtype must be float32, bfloat16 or float16, "
                f"got {self.param_dtype!r}"
            )
        if self.fp8_matmuls not in (False, True) or (
            self.fp8_matmuls and self.param_dtype == "float32"
        ):
            raise ConfigError(
                f"ModelConfig.fp8_matmuls={self.fp8_matmuls!r} with param_dtype "
                f"{self.param_dtype}: FP8 matmuls (a bool) go with 16-bit weights, as "
                f"`--precision fp8` sets them"
            )

    def _check_experts(self) -> None:
        for name in ("num_experts", "experts_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"ModelConfig.{name} must be a whole number, got {value!r}")
        require_finite(
            "ModelConfig",
            False,
            capacity_factor=self.capacity_factor,
            router_aux_loss_coef=self.router_aux_loss_coef,
        )
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(
                f"ModelConfig.experts_per_token={self.experts_per_token} must be 1 to "
                f"num_experts={self.num_experts} (the top-k experts each token is routed to)"
            )
        if not self.num_experts and self.experts_per_token:
            raise ConfigError(
                f"ModelConfig.experts_per_token={self.experts_per_token} needs num_experts > 0"
            )

    def capacity(self, seq: int) -> int:
        """Token slots of each expert in a sequence of `seq` tokens: ceil(k s factor /
        E) (GShard, Lepikhin et al. 2020, Algorithm 1, its group a sequence), at most
        `seq`; `seq` itself when dropless (`capacity_factor` 0)."""
        k, e = self.experts_per_token, self.num_experts
        if not self.capacity_factor:
            return seq
        return min(seq, math.ceil(k * seq * self.capacity_factor / e))

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `num_kv_heads`, or one per query head."""
        return self.num_kv_heads or self.num_heads

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def predictions(self, seq: int) -> int:
        """How many positions of a sequence of `seq` tokens BERT's masked-LM head
        predicts: `max_predictions`, or the ceiling of 15% of them, at most `seq`. The
        reference pre-training data gathers `max_predictions_per_seq` positions a
        sequence (Google's create_pretraining_data.py: 20 at s = 128 and 80 at 512, as
        NVIDIA's BERT also uses; Graphcore's MLPerf BERT 76 at 512)."""
        return min(seq, self.max_predictions or math.ceil(MASKED_LM_PROB * seq))

    def pad_vocab(self, multiple: int) -> ModelConfig:
        """Round the vocabulary up to a multiple, as Megatron-LM's
        `--make-vocab-size-divisible-by` does, so a vocab-parallel embedding divides."""
        require_positive("pad_vocab", multiple=multiple)
        if multiple > self.vocab_size:
            raise ConfigError(
                f"ModelConfig.pad_vocab {multiple} is larger than {self.name}'s vocabulary "
                f"of {self.vocab_size}; pad to a multiple such as 128 (times the mesh's tensor)"
            )
        padded = -(-self.vocab_size // multiple) * multiple
        return self.replace(vocab_size=padded)
