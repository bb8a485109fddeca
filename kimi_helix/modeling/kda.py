"""Kimi Delta Attention (KDA): the gated delta-rule recurrent layer with a fixed-size state.

Per token: q, k, v = SiLU(short causal conv(W x)); q and k L2-normalised; a per-channel forget gate
`g = -exp(A_log) * softplus(f + dt_bias)` (K3: `lb * sigmoid(exp(A_log) * (f + dt_bias))`), `beta = sigmoid(b x)`;
the delta rule `S = (I - beta k k^T) diag(exp g) S + beta k v^T`, `o = S^T q / sqrt(K)`; then a gated RMSNorm and
`o_proj`. State per sequence: the last `W - 1` conv inputs of q, k and v, and the fp32 recurrent state [H, K, V].

On CUDA, without autograd, the projections that read the layer input (q, k, v, f_a, g_a or g, and b) run as one
GEMM, and the two low-rank gates' second halves (f_b, g_b, whose inputs f_a and g_a then lie side by side) as
another: their weights become blocks (views) of packed weights on the first such call, so the checkpoint names
stay as they were (`packing.WeightPack`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels.backends import BackendChoice
from ..kernels.conv import causal_conv1d, causal_conv1d_update
from ..kernels.kda import chunk_kda, fused_recurrent_kda
from ..kernels.linear import linear
from .batch import ForwardBatch, Phase, PhaseRun
from .config import KimiK3Config
from .layers import GatedRMSNorm, Linear
from .packing import WeightPack


class KimiDeltaAttention(nn.Module):
    """KDA layer (`self_attn` of a linear-attention layer). Tensor names follow Kimi-Linear checkpoints."""

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = h = config.kda_num_heads
        self.head_dim = k = config.kda_head_dim
        self.conv_size = w = config.conv_kernel_size
        self.gate_lower_bound = config.gate_lower_bound
        d, p = config.hidden_size, h * k
        self.q_proj = Linear(d, p)
        self.k_proj = Linear(d, p)
        self.v_proj = Linear(d, p)
        # Weight holders only (the conv runs in `kernels.conv`): nn.Conv1d gives checkpoints' [P, 1, W] layout.
        self.q_conv1d = nn.Conv1d(p, p, w, groups=p, bias=False)
        self.k_conv1d = nn.Conv1d(p, p, w, groups=p, bias=False)
        self.v_conv1d = nn.Conv1d(p, p, w, groups=p, bias=False)
        self.A_log = nn.Parameter(torch.empty(1, 1, h, 1))
        self.dt_bias = nn.Parameter(torch.empty(p))
        self.f_a_proj = Linear(d, k)
        self.f_b_proj = Linear(k, p)
        self.b_proj = Linear(d, h)
        self.use_full_rank_gate = config.use_full_rank_gate
        if self.use_full_rank_gate:
            self.g_proj = Linear(d, p)
        else:
            self.g_a_proj = Linear(d, k)
            self.g_b_proj = Linear(k, p)
        self.o_norm = GatedRMSNorm(k, eps=config.rms_norm_eps)
        self.o_proj = Linear(p, d)
        self.backends = BackendChoice()  # the model's choice, set by `KimiK3Model.set_backends`
        self._x_pack = WeightPack()  # the x projections' rows
        self._gate_pack = WeightPack(diagonal=True)  # f_b and g_b, block diagonal over [f_a, g_a]

    def conv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k and v conv weights [P, W] (views): the conv kernels take them as the channel groups of one conv
        over [q, k, v] (one conv state [W-1, 3P]), so no call concatenates them."""
        return tuple(c.weight.squeeze(1) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d))

    def _x_linears(self) -> list[nn.Linear]:
        """The projections that read the layer input x, in their order in the packed weight (f_a next to g_a, so the
        gates' second halves read one slice; read from `_modules` directly: this runs every call, and a submodule
        attribute goes through `nn.Module.__getattr__`)."""
        m = self._modules
        gate = m["g_proj"] if self.use_full_rank_gate else m["g_a_proj"]
        return [m["q_proj"], m["k_proj"], m["v_proj"], m["f_a_proj"], gate, m["b_proj"]]

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [T, P], g (the forget gate's pre-activation) [T, P], the output gate [T, P] and beta [T, H] from
        x [T, d]: two GEMMs where the weights pack (`WeightPack`), else one per projection."""
        linears = self._x_linears()
        packed = self._x_pack.weight(linears, x)
        if packed is None:
            q, k, v, f_a, gate, beta = (lin(x) for lin in linears)
        else:
            y = linear(x, packed)  # automatic, as `layers.Linear`: the Triton GEMV at decode sizes
            q, k, v, f_a, gate, beta = y.split([lin.weight.shape[0] for lin in linears], dim=-1)
        if self.use_full_rank_gate:
            return q, k, v, self.f_b_proj(f_a), gate, beta
        second = [self._modules["f_b_proj"], self._modules["g_b_proj"]]
        if packed is None:  # the halves' inputs lie side by side only in the packed output
            self._gate_pack.forget_replaced(second)
            return q, k, v, second[0](f_a), second[1](gate), beta
        halves = self._gate_pack.weight(second, x)
        if halves is None:
            return q, k, v, second[0](f_a), second[1](gate), beta
        start = sum(lin.weight.shape[0] for lin in linears[:3])
        g, gate = linear(y[..., start : start + 2 * f_a.shape[-1]], halves).chunk(2, dim=-1)
        return q, k, v, g, gate, beta

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """x [T, d] packed tokens -> [T, d].

        `cache.kda_state` gives this layer's conv [slots, W-1, 3P] and fp32 recurrent [slots, H, K, V] state pools
        and the slot of each sequence of the batch; the kernels read and update the pools in place. Each phase
        run takes its own kernels (see `_mix`)."""
        t, (h, k) = x.shape[0], (self.num_heads, self.head_dim)
        conv_state, state, slots = cache.kda_state(self.layer_idx, batch, like=x)
        q, k_, v, g, gate, beta = self._projections(x)
        # the pre-activations of the gate and of beta: the delta-rule kernels apply `kda_gate` and the sigmoid
        # themselves (no separate gate, cast or sigmoid kernels); the conv reads q, k, v as they are (no cat)
        g = g.view(t, h, k)
        outs = [self._mix(run, (q, k_, v), g, beta, conv_state, state, slots, cache) for run in batch.runs()]
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        o = self.o_norm(o, gate.view(t, h, k))
        return self.o_proj(o.reshape(t, h * k))

    def _mix(self, run: PhaseRun, qkv, g, beta, conv_state, state, slots, cache=None) -> torch.Tensor:
        """Short conv and delta rule of one phase run, on its tokens of the batch's q, k, v projections [T, P]
        each, g [T, H, K] and beta [T, H] (pre-activations), and its sequences' `slots` -> o [t, H, V].

        Decodes take the one-token conv update; verify groups and prefill chunks the varlen conv. The delta rule
        runs recurrent (token by token) for decodes and verify groups, chunked for prefill chunks. A run with
        verify groups also hands the cache (`record_verify`, engine caches only) the conv state before the run, the
        conv inputs and the recurrent state after every token, so a partial acceptance can be rolled back."""
        qkv, g, beta, slots = [z[run.tokens] for z in qkv], g[run.tokens], beta[run.tokens], slots[run.seqs]
        t, (h, k), cu = qkv[0].shape[0], (self.num_heads, self.head_dim), run.batch.cu_seqlens
        conv_cu, conv_slots, padding = cu, slots, run.batch.tail_padding
        if padding is not None:  # logits of -inf: beta 0 and decay 1 keep the padding rows out of the state
            pad = padding.padding_rows(t)
            g, beta = g.masked_fill(pad[:, None, None], -math.inf), beta.masked_fill(pad[:, None], -math.inf)
            conv_cu, conv_slots = padding.conv_cu_seqlens, padding.conv_state_indices
        record = Phase.VERIFY in run.batch.phases and hasattr(cache, "record_verify")
        # static per-layer buffers for the records, so that a graph-replayed verify writes them in place (and
        # written there directly: no copy of them afterwards)
        scratch = cache.verify_scratch(self.layer_idx, t, len(slots)) if record else None
        conv_before = inputs = None
        if scratch is not None:
            conv_before, inputs = scratch.conv_before, scratch.inputs
        elif record:
            conv_before = conv_state.new_empty(len(slots), *conv_state.shape[1:])
            inputs = qkv[0].new_empty(t, conv_state.shape[2])
        # the varlen conv writes the records (the states before, the raw inputs) itself, so a run that records takes
        # it even if its groups are single tokens
        if run.decode_path and not record and all(n == 1 for n in run.batch.seq_lens):
            qkv = causal_conv1d_update(
                qkv, conv_state, self.conv_weights(), state_indices=slots, backend=self.backends.kernels
            ).chunk(3, dim=-1)
        else:  # q, k and v each contiguous: the chunked kernels would copy strided ones
            qkv = causal_conv1d(
                [z[None] for z in qkv], self.conv_weights(), conv_state, True, conv_cu, state_indices=conv_slots,
                record_into=(conv_before, inputs) if record else None, split_output=True,
                backend=self.backends.kernels,
            )[0]  # fmt: skip
        q, k_, v = (z.reshape(1, t, h, k) for z in qkv)
        core = fused_recurrent_kda if run.decode_path else chunk_kda
        gate = dict(A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.gate_lower_bound)
        states_out = None if scratch is None else scratch.states
        verify = dict(return_intermediate_states=True, intermediate_states=states_out) if record else {}
        # the chunked kernel plans its chunks on the host: it takes the host's offsets rather than reading cu back
        cu = cu if run.decode_path else run.batch.host_cu_seqlens
        o, states = core(
            q, k_, v, g[None], beta[None], initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu, state_indices=slots, use_beta_sigmoid_in_kernel=True, backend=self.backends.kernels,
            **gate, **verify,
        )  # fmt: skip
        if record:
            cache.record_verify(self.layer_idx, run, conv_before, inputs, states)
        return o[0]
