"""The demo model's architecture and the measures its scripts share (training, report, expected logits).

Size: 8 layers of width 256, KDA:MLA = 3:1 (layers 4 and 8 are MLA), 8 routed experts of width 80 (top 2) plus one
shared expert, tied embeddings over an 8192-token BPE: about 9.3M parameters, so the bf16 weights take under
20 MiB and the repository stays light enough to copy whole to a GPU machine. That is also about the most that a
few minutes of one GPU can train on the ~3M-token standard-library corpus without drifting into memorising it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

# K3 switches: q-LoRA, the MLA output gate, RoPE on the MLA rope part, the lower-bounded KDA forget gate and the
# full-rank KDA output gate (as `presets.py` `tiny-k3`).
DEMO_CONFIG: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 80,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "mla_use_nope": False,
    "mla_use_output_gate": True,
    "gate_lower_bound": -5.0,
    "use_full_rank_gate": True,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8],
        "num_heads": 4,
        "head_dim": 64,
        "short_conv_kernel_size": 4,
    },
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    # Top-2 of 8 with renormalised weights: the chosen experts' weights already sum to 1.
    "routed_scaling_factor": 1.0,
    "model_max_length": 4096,
    "tie_word_embeddings": True,
}


def demo_config(tokenizer) -> Any:
    """`KimiK3Config` of the demo architecture with the tokenizer's vocabulary size and special ids."""
    from kimi_helix.modeling.config import KimiK3Config

    if len(tokenizer) > DEMO_CONFIG["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={DEMO_CONFIG['vocab_size']}")
    ids = {f"{n}_token_id": getattr(tokenizer, f"{n}_token_id") for n in ("bos", "eos", "pad")}
    return KimiK3Config(**DEMO_CONFIG, **ids)


def token_byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: UTF-8 bytes each token stands for (0 for special and unused ids).

    Byte-level BPE spells every byte as one printable character, so a token's length is its byte count."""
    lengths = torch.zeros(vocab_size, dtype=torch.int64)
    special = set(tokenizer.all_special_ids)
    for token, idx in tokenizer.get_vocab().items():
        if idx < vocab_size and idx not in special:
            lengths[idx] = len(token)
    return lengths


@torch.no_grad()
def bits_per_byte(
    model, tokens: torch.Tensor, byte_lengths: torch.Tensor, seq_len: int, batch_size: int, max_windows: int | None
) -> float:
    """Held-out bits per byte: summed next-token NLL (bits) over the UTF-8 bytes of the predicted tokens.

    `tokens` [N] is cut into non-overlapping windows of `seq_len + 1` tokens (the first token of each window is
    context only); `max_windows` evenly spaced windows are used when given. Special tokens (eos) cost bits but
    count no bytes, which makes the figure slightly pessimistic.
    """
    device = next(model.parameters()).device
    n_win = (tokens.numel() - 1) // seq_len
    starts = torch.arange(n_win) * seq_len
    if max_windows is not None and n_win > max_windows:
        starts = starts[torch.linspace(0, n_win - 1, max_windows).long()]
    nll_nats, n_bytes = 0.0, 0
    for chunk in starts.split(batch_size):
        idx = chunk[:, None] + torch.arange(seq_len + 1)
        window = tokens[idx].long().to(device)
        with _autocast(device):
            logits = model(input_ids=window[:, :-1], use_cache=False).logits
        target = window[:, 1:]
        nll_nats += F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="sum").item()
        n_bytes += int(byte_lengths.to(device)[target].sum())
    return nll_nats / math.log(2) / max(n_bytes, 1)


def _autocast(device: torch.device):
    """bf16 autocast on CUDA (as in training); plain fp32 on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def logit_fingerprint(model, ids: list[int], top: int = 16) -> dict[str, list]:
    """What `expected_logits.json` pins for a snippet: fp32 logits of each next token, and the `top` best logits
    (ids and values) after the last token. `model` should run in fp32, so the values agree across CPUs to ~1e-6."""
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    values, best = logits[-1].topk(top)
    return {
        "next_token_logits": logits[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(),
        "last_top_ids": best.tolist(),
        "last_top_logits": values.tolist(),
    }
