"""`DSparkDrafter`: DeepSpec's standalone DSpark drafter, written for kimi-helix.

One forward pass drafts a whole block. The queries are the embeddings of `[anchor, MASK x (gamma - 1)]` at
positions `anchor_pos + 0..gamma-1`; in every layer the keys and values are `[proj(h_ctx); block]`, where
`h_ctx = RMSNorm(fc([H^(l1); ...; H^(lm)]))` fuses the captured target layers of the tokens *strictly before* the
anchor (the anchor itself has not been through the target yet). Attention is non-causal inside the block. Slot k
(0-based) predicts the token at `anchor_pos + k + 1`.

A vanilla Markov head adds `W2(W1[x_{k-1}])` to slot k's logits (x_{-1} = the anchor), so drafts are sampled left
to right from exact per-token distributions, and a confidence head `Linear(d + r, 1)` on `[h_k; W1[x_{k-1}]]`
predicts slot k's acceptance given that every earlier slot was accepted.

The embedding and LM head are the target's, shared and frozen: `bind_target` attaches them; they are neither
parameters of the drafter nor saved with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from ...kernels.backends import BackendChoice
from ...kernels.draft_attention import draft_attention
from ...kernels.linear import linear
from ...kernels.markov import markov_chain_greedy
from ...kernels.norm_rotary import norm_rotary, norm_rotary_into_cache
from ...modeling.checkpoint import CheckpointError
from ...modeling.layers import RMSNorm, SwiGLU, fused_projections
from ...modeling.packing import WeightPack
from .config import DSparkConfig

WEIGHTS_FILE = "model.safetensors"


@dataclass
class DSparkOutput:
    """Teacher-forced outputs for a batch of blocks: `logits` [..., gamma, V] (Markov-corrected) and
    `confidence_logits` [..., gamma] (None without a confidence head)."""

    logits: torch.Tensor
    confidence_logits: torch.Tensor | None


@dataclass
class Draft:
    """Sampled drafts of N requests: `tokens` [N, k] int64, `probs` [N, k, V] fp32 (the distributions the tokens
    were drawn from, Markov-corrected and tempered; one-hot for greedy rows; None when not asked for),
    `confidence` [N, k] in [0, 1] (None without a confidence head)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidence: torch.Tensor | None


@dataclass
class SlotContext:
    """The injected context of N drafting requests where the serving cache keeps it: per drafter layer (k, v)
    [S, C, H, hd] (S slots of C rows, row = position), each request's slot [N] int64 and its visible rows
    `lengths` [N] int64 (rows 0..length-1: the tokens before its anchor, so length <= the anchor's position)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    slots: torch.Tensor
    lengths: torch.Tensor


class DSparkAttention(nn.Module):
    """Softmax attention of the block over `[context; block]`, with per-head q/k RMSNorm and RoPE.

    q, k and v read the same input: where the weights pack (CUDA, no autograd, `WeightPack`) they are one GEMM,
    and the context's k and v one GEMM over the packed weight's k and v rows."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        d, h, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.num_heads, self.head_dim, self.theta = h, hd, config.rope_theta
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, h * hd, bias=False)
        self.v_proj = nn.Linear(d, h * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self._qkv_pack = WeightPack()
        self.backends = BackendChoice()  # the drafter's choice, set by `DSparkDrafter.set_backends`

    def _qkv(self) -> list[nn.Linear]:
        m = self._modules
        return [m["q_proj"], m["k_proj"], m["v_proj"]]

    def _project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [..., H*hd] of x [..., d]: one launch over the packed weight's k and v rows where it packs."""
        packed = self._qkv_pack.weight(self._qkv(), x)
        if packed is None:
            return self.k_proj(x), self.v_proj(x)
        k, v = linear(x, packed[self.q_proj.weight.shape[0] :]).chunk(2, dim=-1)
        return k, v

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n * H*hd] -> [T, n * H, hd] (a view where x's rows allow)."""
        return x.reshape(-1, x.shape[-1] // self.head_dim, self.head_dim)

    def _norm_rotate(self, x: torch.Tensor, positions: torch.Tensor, norms: list[RMSNorm]) -> torch.Tensor:
        """Per-head RMSNorm then RoPE in one op: x [..., C, n * H*hd] (n = len(norms): q's heads, k's, or both side
        by side), positions [..., C] -> [..., C, n * H, hd]."""
        eps = norms[0].eps
        weights = [norm.weight for norm in norms]
        y = norm_rotary(self._heads(x), positions.reshape(-1), weights, eps, self.theta, backend=self.backends.kernels)
        return y.view(*x.shape[:-1], len(norms) * self.num_heads, self.head_dim)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., C, d], positions [..., C] -> k, v [..., C, H, hd] (k normed and rotated)."""
        k, v = self._project_kv(x)
        return self._norm_rotate(k, positions, [self.k_norm]), v.view(*v.shape[:-1], self.num_heads, self.head_dim)

    def write_keys_values(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """`keys_values` of x [T, d] written into a context cache k_cache, v_cache [S, C, H, hd] at (slots,
        positions) [T]: the projection, then the keys' norm and rotary and both writes in one launch."""
        k, v = self._project_kv(x)
        norm = self.k_norm
        norm_rotary_into_cache(self._heads(k), self._heads(v), positions, norm.weight, norm.eps, self.theta, k_cache,
                               v_cache, slots, backend=self.backends.kernels)  # fmt: skip

    def _block_qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [N, G, d], positions [N, G] -> the block's q, k (normed and rotated) and v, each [N, G, H, hd]. Where
        the weights pack, q's and k's heads sit side by side in one projection and are normed and rotated in one
        launch."""
        h, hd = self.num_heads, self.head_dim
        packed = self._qkv_pack.weight(self._qkv(), x)
        if packed is not None:
            y = linear(x, packed)
            qk = self._norm_rotate(y[..., : 2 * h * hd], positions, [self.q_norm, self.k_norm])
            q, k = qk.split(h, dim=-2)
            return q, k, y[..., 2 * h * hd :].view(*x.shape[:2], h, hd)
        q, k, v = fused_projections(x, self._qkv())
        q, k = self._norm_rotate(q, positions, [self.q_norm]), self._norm_rotate(k, positions, [self.k_norm])
        return q, k, v.view(*x.shape[:2], h, hd)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """x [N, G, d] block, positions [N, G]; ctx_k/ctx_v [N, C, H, hd]; visible [N, 1, 1, C + G] bool, the keys
        each query sees (`DSparkDrafter.backbone`'s, shared by the layers) -> [N, G, d]. Differentiable."""
        n, g, _ = x.shape
        q, k_blk, v_blk = self._block_qkv(x, positions)
        k = torch.cat([ctx_k, k_blk], dim=1).transpose(1, 2)
        v = torch.cat([ctx_v, v_blk], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible)
        return self.o_proj(out.transpose(1, 2).reshape(n, g, -1))

    def forward_cached(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` over context rows read in place from the serving cache (one `draft_attention` launch where
        the switch picks Triton, instead of a gather, a concatenation, a mask and SDPA): x [N, G, d],
        positions [N, G]; k_cache/v_cache [S, C, H, hd]; slots, lengths [N] (see `SlotContext`) -> [N, G, d]."""
        n, g, _ = x.shape
        q, k_blk, v_blk = self._block_qkv(x, positions)
        out = draft_attention(q, k_blk, v_blk, k_cache, v_cache, slots, lengths, backend=self.backends.kernels)
        return self.o_proj(out.reshape(n, g, -1))


class DSparkLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x), context)`, then `x + mlp(norm(x))` (the residual add and the MLP's norm in
    one kernel)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DSparkAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x, positions, ctx_k, ctx_v, visible):
        return self._finish(self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, visible), x)

    def forward_cached(self, x, residual, positions, k_cache, v_cache, slots, lengths):
        """The layer over the serving cache, with the residual add left to the next norm: x [N, G, d] the previous
        layer's MLP output (or the embeddings, with residual None), residual [N, G, d] -> (this layer's MLP
        output, the residual stream before it); the stream is their sum."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        attn = self.self_attn.forward_cached(h, positions, k_cache, v_cache, slots, lengths)
        h, residual = self.post_attention_layernorm.forward_add(attn, residual)
        return self.mlp(h), residual

    def _finish(self, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h, x = self.post_attention_layernorm.forward_add(attn, x)
        return x + self.mlp(h)


class DSparkDrafter(PreTrainedModel):
    """The DSpark drafter; see the module docstring for the maths and `DSparkConfig` for the fields."""

    config_class = DSparkConfig
    base_model_prefix = "dspark"
    _no_split_modules = ["DSparkLayer"]

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        d, r = config.hidden_size, config.markov_rank
        self.fc = nn.Linear(config.num_captured_layers * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.markov_embed = nn.Embedding(config.vocab_size, r) if r else None  # W1
        self.markov_proj = nn.Linear(r, config.vocab_size, bias=False) if r else None  # W2
        self.confidence_head = nn.Linear(d + r, 1) if config.enable_confidence_head else None
        self._target_io: tuple[nn.Embedding, nn.Linear] | None = None  # the target's, not registered here
        self.backends = BackendChoice()  # the engine's choice, set by `set_backends`
        self.post_init()

    def set_backends(self, backends: BackendChoice) -> None:
        """Route the kernel calls of the drafter (norms, rotary, MLP, Markov chain) through `backends`, as
        `KimiK3Model.set_backends` does for the target."""
        for module in self.modules():
            if hasattr(module, "backends"):
                module.backends = backends

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)

    # ---------------------------------------------------------------- the target's embedding and head
    def bind_target(self, target: nn.Module) -> None:
        """Share the target's input embedding and LM head (frozen); raises if their shapes do not fit.

        Under tensor / Helix parallelism these are the target's vocab-parallel modules (`parallel.tp`: rows split
        over all tp * cp ranks, with their collectives inside), so the drafter's IO runs on that CP-free mapping
        while its own small layers are replicated on every rank."""
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        vocab, d = self.config.vocab_size, self.config.hidden_size
        for name, module in (("embedding", embed), ("lm_head", head)):
            comm = getattr(module, "comm", None)  # set on the vocab-parallel modules only
            want = (vocab if comm is None else vocab // comm.mapping.world_size, d)
            if tuple(module.weight.shape) != want:
                raise ValueError(
                    f"target {name} is {tuple(module.weight.shape)}, the drafter needs [vocab, d] = [{vocab}, {d}]"
                    + ("" if comm is None else f" split into {comm.mapping.world_size} vocab shards")
                )
        embed.weight.requires_grad_(False)
        head.weight.requires_grad_(False)
        self._target_io = (embed, head)

    def _io(self) -> tuple[nn.Embedding, nn.Linear]:
        if self._target_io is None:
            raise RuntimeError("DSparkDrafter needs the target's embedding and LM head: call bind_target(target)")
        return self._target_io

    # ---------------------------------------------------------------- pieces shared by training and drafting
    def context_keys_values(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, the injected context keys/values of captured target features.

        features [..., C, m*d] (captured layers concatenated in `target_layer_ids` order), positions [..., C]
        -> per layer (k, v), each [..., C, H, hd].
        """
        h_ctx = self.hidden_norm(self.fc(features))
        return [layer.self_attn.keys_values(h_ctx, positions) for layer in self.layers]

    def write_context(
        self, features: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, kv: list[tuple[torch.Tensor, ...]]
    ) -> None:
        """`context_keys_values` of T tokens written into a serving context cache: features [T, m*d], slots and
        positions [T] int64, kv per layer (k, v) [S, C, H, hd], written at [slot, position] (one launch a layer
        after the projections)."""
        h_ctx = self.hidden_norm(self.fc(features))
        for layer, (k, v) in zip(self.layers, kv, strict=True):
            layer.self_attn.write_keys_values(h_ctx, positions, k, v, slots)

    def backbone(
        self,
        block_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        ctx: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_positions: torch.Tensor,
        ctx_valid: torch.Tensor,
    ) -> torch.Tensor:
        """block_ids [N, G] (`[anchor, MASK...]`), anchor_positions [N]; ctx per layer (k, v) [N, C, H, hd] with
        ctx_positions / ctx_valid [N, C] -> final-normed hidden states [N, G, d]. Context rows at or after the
        anchor's position are masked out."""
        g = block_ids.shape[1]
        positions = anchor_positions[:, None] + torch.arange(g, device=block_ids.device)
        # the keys each query sees, built once for all layers: the valid context before the anchor, and the whole
        # block (non-causal inside it)
        visible = F.pad(ctx_valid & (ctx_positions < anchor_positions[:, None]), (0, g), value=True)
        visible = visible[:, None, None, :]
        x = self._io()[0](block_ids)
        for layer, (k, v) in zip(self.layers, ctx, strict=True):
            x = layer(x, positions, k, v, visible)
        return self.norm(x)

    def backbone_cached(
        self, block_ids: torch.Tensor, anchor_positions: torch.Tensor, context: SlotContext
    ) -> torch.Tensor:
        """`backbone` over the serving cache's context rows, read in place: block_ids [N, G], anchor_positions
        [N], `context` (its lengths at most the anchors' positions) -> final-normed hidden states [N, G, d]."""
        positions = anchor_positions[:, None] + torch.arange(block_ids.shape[1], device=block_ids.device)
        x, residual = self._io()[0](block_ids), None
        for layer, (k, v) in zip(self.layers, context.kv, strict=True):
            x, residual = layer.forward_cached(x, residual, positions, k, v, context.slots, context.lengths)
        return self.norm.forward_add(x, residual)[0]

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """prev_ids [...] -> W2(W1[prev]) [..., V], or None without a Markov head."""
        return None if self.markov_embed is None else self.markov_proj(self.markov_embed(prev_ids))

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """hidden [..., d], prev_ids [...] -> logit of c_k [...] (None without a confidence head)."""
        if self.confidence_head is None:
            return None
        feats = hidden if self.markov_embed is None else torch.cat([hidden, self.markov_embed(prev_ids)], -1)
        return self.confidence_head(feats).squeeze(-1).float()

    # ---------------------------------------------------------------- training (teacher-forced)
    def forward(
        self,
        input_ids: torch.Tensor,
        target_features: torch.Tensor,
        anchor_positions: torch.Tensor,
        **kwargs,
    ) -> DSparkOutput:
        """Teacher-forced blocks at A anchors of B sequences.

        Args:
            input_ids: [B, S] the sequences.
            target_features: [B, S, m*d] captured target layers per token.
            anchor_positions: [B, A] anchors, each with `anchor + block_size < S` (every label exists).

        Returns `DSparkOutput` with logits [B, A, G, V] and confidence logits [B, A, G]; slot k's label is
        `labels_for(input_ids, anchor_positions)[..., k] = input_ids[anchor + k + 1]`.
        """
        b, s = input_ids.shape
        a, g = anchor_positions.shape[1], self.config.block_size
        labels = self.labels_for(input_ids, anchor_positions)
        anchors = input_ids.gather(1, anchor_positions)
        block = torch.full((b, a, g), self.config.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
        block[..., 0] = anchors
        ctx_pos = torch.arange(s, device=input_ids.device).expand(b, s)
        ctx = [
            tuple(t[:, None].expand(b, a, *t.shape[1:]).reshape(b * a, *t.shape[1:]) for t in kv)
            for kv in self.context_keys_values(target_features, ctx_pos)
        ]
        pos = ctx_pos[:, None].expand(b, a, s).reshape(b * a, s)
        hidden = self.backbone(
            block.view(b * a, g), anchor_positions.reshape(-1), ctx, pos, torch.ones_like(pos, dtype=torch.bool)
        )
        hidden = hidden.view(b, a, g, -1)
        prev = torch.cat([anchors[..., None], labels[..., :-1]], dim=-1)
        logits = self._io()[1](hidden).float()
        bias = self.markov_bias(prev)
        if bias is not None:
            logits = logits + bias.float()
        return DSparkOutput(logits, self.confidence_logits(hidden, prev))

    def labels_for(self, input_ids: torch.Tensor, anchor_positions: torch.Tensor) -> torch.Tensor:
        """[B, A, G]: slot k of the block at anchor p is labelled with `input_ids[p + k + 1]`."""
        g, s = self.config.block_size, input_ids.shape[1]
        idx = anchor_positions[..., None] + 1 + torch.arange(g, device=input_ids.device)
        if int(idx.max()) >= s or int(anchor_positions.min()) < 0:
            raise ValueError(f"anchors must satisfy 0 <= anchor and anchor + block_size ({g}) < seq_len ({s})")
        return input_ids[:, None, :].expand(-1, idx.shape[1], -1).gather(2, idx)

    # ---------------------------------------------------------------- drafting
    @torch.no_grad()
    def draft(
        self,
        anchor_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        context: SlotContext,
        num_tokens: int,
        temperatures: list[float],
        generators: list[torch.Generator | None],
        with_probs: bool = True,
    ) -> Draft:
        """Draft `num_tokens` (<= block_size) tokens for N requests, left to right through the Markov head.

        anchor_ids, anchor_positions [N]; `context` holds the drafter's keys/values of the tokens before each
        anchor (row = position). Rows with temperature < 1e-5 draft greedily.
        `with_probs=False` leaves `Draft.probs` None (a greedy batch needs none). Batched over the rows; with
        every row greedy nothing reads a device value on the host (a CUDA graph can capture it).
        """
        from ...engine.sampling import GREEDY_TEMPERATURE

        n, g = anchor_ids.shape[0], self.config.block_size
        if not 1 <= num_tokens <= g:
            raise ValueError(f"num_tokens must be in 1..block_size={g}, got {num_tokens}")
        sampled = [i for i, t in enumerate(temperatures) if t >= GREEDY_TEMPERATURE]
        device = anchor_ids.device
        block = F.pad(anchor_ids[:, None], (0, g - 1), value=self.config.mask_token_id)  # [anchor, MASK...]
        hidden = self.backbone_cached(block, anchor_positions, context)[:, :num_tokens]
        base = self._io()[1](hidden)  # the greedy chain reads the head's dtype as fp32 itself
        if not sampled and self.markov_embed is not None:
            # the whole chain and the confidence head in one op: one Triton launch where the switch picks it
            head = self.confidence_head
            conf_args = () if head is None else (hidden, head.weight[0], head.bias)
            embed, proj = self.markov_embed.weight, self.markov_proj.weight
            tokens, conf = markov_chain_greedy(base, anchor_ids, embed, proj, *conf_args, backend=self.backends.kernels)
            probs = None
        else:
            tokens, probs, conf = self._draft_chain(
                anchor_ids, hidden, base.float(), sampled, temperatures, generators, with_probs
            )
        if with_probs:
            one_hot = F.one_hot(tokens, base.shape[-1]).float()
            if probs is None:
                probs = one_hot
            else:  # greedy rows draw from a point mass
                greedy = torch.tensor([i not in sampled for i in range(n)], device=device)
                probs = torch.where(greedy[:, None, None], one_hot, probs)
        return Draft(tokens, probs, conf)

    def _draft_chain(self, anchor_ids, hidden, base, sampled, temperatures, generators, with_probs):
        """`draft`'s chain slot by slot, where some rows sample (`sampled`, their indices) or there is no Markov
        head: hidden [N, K, d], base [N, K, V] fp32 -> (tokens [N, K], the distributions [N, K, V] when
        `with_probs` and some row samples else None, confidence [N, K] or None)."""
        from ...engine.sampling import GREEDY_TEMPERATURE

        n, num_tokens, device = anchor_ids.shape[0], base.shape[1], anchor_ids.device
        if sampled:
            temps = torch.tensor([max(t, GREEDY_TEMPERATURE) for t in temperatures], device=device)[:, None]
            rows = torch.tensor(sampled, device=device)
        # slot k's tokens are row k of a [k, N] buffer (an argmax writes a contiguous row in place)
        tokens = torch.empty(num_tokens, n, dtype=torch.long, device=device).t()
        probs = torch.empty_like(base) if with_probs and sampled else None
        prev = anchor_ids
        for k in range(num_tokens):
            logits = base[:, k]
            bias = self.markov_bias(prev)
            if bias is not None:
                logits = torch.add(logits, bias)  # fp32 + bf16 -> fp32, as `logits + bias.float()`
            torch.argmax(logits, dim=-1, out=tokens[:, k])
            if sampled:
                p = torch.softmax(logits / temps, dim=-1)
                draws = [torch.multinomial(p[i], 1, generator=generators[i]) for i in sampled]
                tokens[:, k].index_copy_(0, rows, torch.cat(draws))
                if probs is not None:
                    probs[:, k] = p
            prev = tokens[:, k]
        conf = None
        if self.confidence_head is not None:  # every slot at once: it reads the chain's tokens, never feeds it
            prevs = torch.cat([anchor_ids[:, None], tokens[:, :-1]], dim=1)
            conf = torch.sigmoid(self.confidence_logits(hidden, prevs))
        return tokens, probs, conf

    # ---------------------------------------------------------------- checkpoints
    def save_pretrained(self, save_directory, **kwargs) -> None:
        """Write config.json and model.safetensors (the shared embedding and LM head are the target's: not saved)."""
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(path)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> DSparkDrafter:
        """Load a local drafter folder (config.json + model.safetensors; no remote code, no pickles).

        Keyword args: `dtype` (torch dtype), `device`. Raises `CheckpointError` naming missing, unexpected or
        wrong-shape tensors. Call `bind_target` before use.
        """
        path = Path(pretrained_model_name_or_path)
        if model_args:
            raise TypeError(f"{cls.__name__}.from_pretrained takes no extra positional arguments, got {model_args}")
        if not (path / WEIGHTS_FILE).is_file():
            raise CheckpointError(
                f"{path} has no {WEIGHTS_FILE}; a drafter folder holds config.json and {WEIGHTS_FILE}"
            )
        config = kwargs.pop("config", None) or DSparkConfig.from_pretrained(path)
        model = cls(config)
        state = load_file(str(path / WEIGHTS_FILE))
        own = model.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        wrong = [k for k in set(own) & set(state) if own[k].shape != state[k].shape]
        if missing or unexpected or wrong:
            raise CheckpointError(
                f"drafter checkpoint {path}: missing {missing}, unexpected {unexpected}, wrong shape {sorted(wrong)}"
            )
        model.load_state_dict(state)
        dtype, device = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None), kwargs.pop("device", None)
        return model.to(device=device, dtype=dtype).eval()
