"""Short causal depthwise convolution ops (the KDA q/k/v ShortConvolution)."""

from kimi_helix.kernels.conv.naive import causal_conv1d, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update"]
