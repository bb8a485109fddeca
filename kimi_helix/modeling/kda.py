"""Kimi Delta Attention (KDA): the gated delta-rule recurrent layer with a fixed-size state.

Per token: q, k, v = SiLU(short causal conv(W x)); q and k L2-normalised; a per-channel forget gate
`g = -exp(A_log) * softplus(f + dt_bias)` (K3: `lb * sigmoid(exp(A_log) * (f + dt_bias))`), `beta = sigmoid(b x)`;
the delta rule `S = (I - beta k k^T) diag(exp g) S + beta k v^T`, `o = S^T q / sqrt(K)`; then a gated RMSNorm and
`o_proj`. State per sequence: the last `W - 1` conv inputs of q, k and v, and the fp32 recurrent state [H, K, V].

On CUDA, without autograd, the projections that read the layer input (q, k, v, f_a, b and g_a or g) run as one
GEMM: their weights become row blocks (views) of one packed weight on the first such call, so the checkpoint names
and the memory stay as they were (see `_packed_weight`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.backends import BackendChoice
from ..kernels.conv import causal_conv1d, causal_conv1d_update
from ..kernels.kda import chunk_kda, fused_recurrent_kda
from ..kernels.linear import linear
from .batch import ForwardBatch, Phase, PhaseRun
from .config import KimiK3Config
from .layers import GatedRMSNorm, Linear, plain_linear

# Devices on which the x projections run as one GEMM over a packed weight (`KimiDeltaAttention._packed_weight`).
PACK_DEVICES = ("cuda",)
_MAX_PACKINGS = 2  # the first, and one after a conversion (`model.to(...)`) replaced the weights


def _row_blocks_of(packed: torch.Tensor, ws: list[torch.Tensor]) -> bool:
    """Whether `ws` are, in order, the contiguous row blocks of `packed` that tile it (none was replaced)."""
    start, base, size = 0, packed.data_ptr(), packed.element_size()
    for w in ws:
        if w.device != packed.device or w.dtype != packed.dtype or not w.is_contiguous():
            return False
        if w.dim() != 2 or w.shape[1] != packed.shape[1] or w.data_ptr() != base + start * size:
            return False
        start += w.numel()
    return start == packed.numel()


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
        self._packed: torch.Tensor | None = None  # the x projections' one weight, see `_packed_weight`
        self._packings = 0
        self._packed_key: list = []  # (module id, data_ptr, dtype, shape) of each x projection when packed

    def conv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k and v conv weights [P, W] (views): the conv kernels take them as the channel groups of one conv
        over [q, k, v] (one conv state [W-1, 3P]), so no call concatenates them."""
        return tuple(c.weight.squeeze(1) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d))

    def _x_linears(self) -> list[nn.Linear]:
        """The projections that read the layer input x, in their order in the packed weight (read from `_modules`
        directly: this runs every call, and a submodule attribute goes through `nn.Module.__getattr__`)."""
        m = self._modules
        gate = m["g_proj"] if self.use_full_rank_gate else m["g_a_proj"]
        return [m["q_proj"], m["k_proj"], m["v_proj"], m["f_a_proj"], m["b_proj"], gate]

    def _packed_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """One weight [sum of outputs, d] whose row blocks the x projections' weights are views of, packed on the
        first call that can use it; None where the separate GEMMs run instead: off `PACK_DEVICES` (the packing
        only saves launches, and safetensors refuses to save CPU tensors that share storage), when autograd is on
        for the weights, where a projection is not a plain `nn.Linear` (`layers.plain_linear`: a hook or wrapper must
        run), during a CUDA-graph capture that finds nothing packed, or once the weights were replaced
        again after a repacking (a hook that swaps them on every call, as accelerate's offloading does, would
        otherwise keep a packed copy alive)."""
        linears = self._x_linears()
        ws = [lin._parameters["weight"] for lin in linears]
        if x.device.type not in PACK_DEVICES or (torch.is_grad_enabled() and any(w.requires_grad for w in ws)):
            return None
        # the same modules, and weights of the same storage, dtype and shape as when packed
        key = [(id(lin), w.data_ptr(), w.dtype, w.shape) for lin, w in zip(linears, ws)]
        if self._packed is not None and key == self._packed_key:
            return self._packed
        self._packed = None
        if self._packings == _MAX_PACKINGS or not all(plain_linear(lin, x) for lin in linears):
            return None
        if any(w.dtype != ws[0].dtype for w in ws):
            return None
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # a graph would replay the packing copy from the freed weights: pack in the warm-up instead
        with torch.no_grad(), torch.inference_mode(False):
            packed = torch.cat([w.detach() for w in ws])
            start = 0
            for w in ws:  # the same Parameter objects, now views: in-place updates (loading, optimisers) reach it
                w.data = packed[start : start + w.shape[0]]
                start += w.shape[0]
        assert _row_blocks_of(packed, ws)
        self._packed, self._packings = packed, self._packings + 1
        self._packed_key = [(id(lin), w.data_ptr(), w.dtype, w.shape) for lin, w in zip(linears, ws)]
        return packed

    def _x_projections(self, x: torch.Tensor) -> list[torch.Tensor]:
        """q, k, v [T, P], f_a [T, K], b [T, H], g_a [T, K] (or g [T, P]): one GEMM where `_packed_weight` allows."""
        linears = self._x_linears()
        packed = self._packed_weight(x)
        if packed is None:
            return [lin(x) for lin in linears]
        y = linear(x, packed)  # automatic, as `layers.Linear`: the Triton GEMV at decode sizes
        return list(y.split([lin.weight.shape[0] for lin in linears], dim=-1))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """x [T, d] packed tokens -> [T, d].

        `cache.kda_state` gives this layer's conv [slots, W-1, 3P] and fp32 recurrent [slots, H, K, V] state pools
        and the slot of each sequence of the batch; the kernels read and update the pools in place. Each phase
        run takes its own kernels (see `_mix`)."""
        t, (h, k) = x.shape[0], (self.num_heads, self.head_dim)
        conv_state, state, slots = cache.kda_state(self.layer_idx, batch, like=x)
        q, k_, v, f_a, beta, gate = self._x_projections(x)
        # the pre-activations of the gate and of beta: the delta-rule kernels apply `kda_gate` and the sigmoid
        # themselves (no separate gate, cast or sigmoid kernels); the conv reads q, k, v as they are (no cat)
        g = self.f_b_proj(f_a).view(t, h, k)
        outs = [self._mix(run, (q, k_, v), g, beta, conv_state, state, slots, cache) for run in batch.runs()]
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        gate = gate if self.use_full_rank_gate else self.g_b_proj(gate)
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
        record = Phase.VERIFY in run.batch.phases and hasattr(cache, "record_verify")
        conv_before, inputs = (conv_state[slots].clone(), torch.cat(qkv, dim=-1)) if record else (None, None)
        # a static per-layer buffer for the per-token states, so that a graph-replayed verify writes in place
        scratch = cache.verify_scratch(self.layer_idx, t) if record and hasattr(cache, "verify_scratch") else None
        if run.decode_path and all(n == 1 for n in run.batch.seq_lens):
            qkv = causal_conv1d_update(
                qkv, conv_state, self.conv_weights(), state_indices=slots, backend=self.backends.kernels
            )
        else:
            qkv = causal_conv1d(
                [z[None] for z in qkv], self.conv_weights(), conv_state, True, cu, state_indices=slots,
                backend=self.backends.kernels,
            )[0][0]  # fmt: skip
        q, k_, v = (z.reshape(1, t, h, k) for z in qkv.chunk(3, dim=-1))
        core = fused_recurrent_kda if run.decode_path else chunk_kda
        gate = dict(A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.gate_lower_bound)
        verify = dict(return_intermediate_states=True, intermediate_states=scratch) if record else {}
        o, states = core(
            q, k_, v, g[None], beta[None], initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu, state_indices=slots, use_beta_sigmoid_in_kernel=True, backend=self.backends.kernels,
            **gate, **verify,
        )  # fmt: skip
        if record:
            cache.record_verify(self.layer_idx, run, conv_before, inputs, states)
        return o[0]
