"""Kimi Delta Attention (KDA) ops."""

from kimi_helix.kernels.kda.naive import kda_gate, l2norm, naive_chunk_kda, naive_recurrent_kda

__all__ = ["kda_gate", "l2norm", "naive_chunk_kda", "naive_recurrent_kda"]
