"""Published formulas the estimate is checked against, transcribed for a dense GPT (LayerNorm with
bias, GeLU MLP of 4h, multi-head attention, bf16): nothing here is computed by remat.

- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198), Table 2: activation bytes per transformer layer;
- Megatron-LM, ``megatron/training/theoretical_memory_usage.py`` (NVIDIA/Megatron-LM at commit
  d98e8a64ddf3), ``compute_weight_and_optimizer_memory`` and ``compute_activation_memory``;
- Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", Figure 1 and Table 1: model-state bytes per device under ZeRO's three stages.
"""

from __future__ import annotations


def korthikanti_layer(*, s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                      selective: bool = False) -> float:
    """Table 2: sbh(34 + 5as/h) without parallelism; sbh(10 + 24/t + 5as/(ht)) with tensor
    parallelism; sbh(34/t + 5as/(ht)) with sequence parallelism too; selective recomputation
    drops the 5as/(ht) term."""
    core = 0.0 if selective else 5 * a * s / (h * t)
    whole = 34 / t if sequence_parallel else 10 + 24 / t
    return s * b * h * (whole + core)


def korthikanti_full(*, s: int, b: int, h: int) -> float:
    """Table 2, full activation recomputation: the layer's input, 2sbh."""
    return 2 * s * b * h


def megatron_weight_and_optimizer(*, h: int, layers: int, vocab: int, t: int, p: int, d: int,
                                  distributed_optimizer: bool, untied: bool) -> float:
    """``compute_weight_and_optimizer_memory`` for a dense GPT without GQA, SwiGLU, MoE or MTP,
    with ``ffn_hidden_size = 4h`` and LayerNorm (``norm_size = 2``): bytes on the most loaded
    shard (the first stage)."""
    attention = 2 * h * h * ((1 + 1) * 1)  # self_attn_term: num_query_groups = heads, kv_channels * heads = h
    mlp = 2 * h * (4 * h) * 1  # dense_mlp_params, gated_linear_multiplier 1
    layernorm = 2 * h * 2
    final_layernorm = 2 * h
    embedding = h * vocab
    tp_sharded_block = (attention + mlp) * layers
    replicated_block = layernorm * layers + final_layernorm
    tp_sharded = (tp_sharded_block / p + embedding) / t
    replicated = replicated_block / p
    if untied and p == 1:
        tp_sharded += embedding / t
    per_param = 6 + 12 / d if distributed_optimizer else 18
    return (tp_sharded + replicated) * per_param


def megatron_activation_sp_selective(*, s: int, b: int, h: int, layers: int, t: int, p: int,
                                     virtual: int | None, micro_batches: int | None) -> float:
    """``compute_activation_memory`` (used with sequence parallelism and selective recomputation)
    for ``ffn_hidden_size = 4h``, on the first pipeline stage, ``p > 1`` (no output layer term)."""
    memory = s * b * h * (18 + 4 * (4 * h / h)) * layers
    memory += 8 * s * b * p  # input to embedding
    memory += s * b * h * p  # dropout in embedding layer
    if virtual is not None:
        memory *= 1 + (p - 1) / (p * virtual)
    elif p > 1 and micro_batches is not None:
        memory *= min(1, micro_batches / p)
    return memory / t


def interleaved_in_flight(p: int, v: int) -> float:
    """Korthikanti et al. 2022, section 4.2.3: the interleaved schedule's first stage holds
    ``L (1 + (p - 1)/(p v))`` layers' activations, p x (1 + (p - 1)/(p v)) micro-batches of L/p."""
    return p * (1 + (p - 1) / (p * v))


def zero_per_rank(psi: float, n: int, stage: int) -> float:
    """Rajbhandari et al. 2020 (ZeRO), Figure 1 and Table 1, mixed-precision Adam (K = 12):
    16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N, 16 Psi/N bytes per device."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


__all__ = ["interleaved_in_flight", "korthikanti_full", "korthikanti_layer", "megatron_activation_sp_selective",
           "megatron_weight_and_optimizer", "zero_per_rank"]
