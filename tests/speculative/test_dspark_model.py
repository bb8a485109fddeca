"""The DSpark drafter: slot convention, context visibility, drafting = teacher forcing, checkpoints, sharing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModel

from kimi_helix.kernels.backends import BackendChoice
from kimi_helix.modeling import CheckpointError
from kimi_helix.speculative.dspark import DSparkDrafter, SlotContext, TargetFeatureCapture

from .conftest import tiny_drafter_config


def _features(target, ids):
    with TargetFeatureCapture(target, [0, 2]) as cap:
        target(ids)
        return cap.pop().view(*ids.shape, -1)


def test_slot_k_is_labelled_with_anchor_plus_k_plus_1(drafter):
    ids = torch.arange(100, 120)[None]
    anchors = torch.tensor([[0, 5, 15]])
    labels = drafter.labels_for(ids, anchors)
    for a, p in enumerate(anchors[0].tolist()):
        assert labels[0, a].tolist() == [100 + p + k + 1 for k in range(drafter.config.block_size)]
    with pytest.raises(ValueError, match="anchor \\+ block_size"):
        drafter.labels_for(ids, torch.tensor([[16]]))


def test_context_is_strictly_before_the_anchor(target, drafter):
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, 16))
    feats = _features(target, ids)
    anchor = torch.tensor([[8]])
    base = drafter(ids, feats, anchor).logits
    later = feats.clone()
    later[:, 8:] += torch.randn_like(later[:, 8:])  # the anchor's own features and everything after it
    assert torch.equal(drafter(ids, later, anchor).logits, base)
    earlier = feats.clone()
    earlier[:, 7] += 1.0
    assert not torch.allclose(drafter(ids, earlier, anchor).logits, base)


def test_attention_is_non_causal_inside_the_block(target, drafter):
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (1, 10))
    ctx = drafter.context_keys_values(_features(target, ids), torch.arange(10)[None])
    block = torch.tensor([[5, 258, 258, 258]])

    def run(b):
        return drafter.backbone(b, torch.tensor([10]), ctx, torch.arange(10)[None], torch.ones(1, 10, dtype=torch.bool))

    changed = block.clone()
    changed[0, 3] = 7
    assert not torch.allclose(run(block)[0, 0], run(changed)[0, 0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafting_matches_teacher_forcing(target, drafter, temperature):
    """Drafted tokens fed back as labels reproduce the draft's distributions slot for slot (same convention in
    both paths: slot k sits at anchor + k and predicts anchor + k + 1)."""
    torch.manual_seed(4)
    p, g = 9, drafter.config.block_size
    ids = torch.randint(0, 256, (1, p + 1))
    feats = _features(target, ids)
    ctx = drafter.context_keys_values(feats[:, :p], torch.arange(p)[None])
    gen = torch.Generator().manual_seed(0)
    context = SlotContext(ctx, torch.tensor([0]), torch.tensor([p]))
    draft = drafter.draft(ids[:, p], torch.tensor([p]), context, g, [temperature], [gen])
    full = torch.cat([ids, draft.tokens], dim=1)
    feats_full = torch.cat([feats, feats.new_zeros(1, g, feats.shape[-1])], dim=1)  # rows >= p are never seen
    out = drafter(full, feats_full, torch.tensor([[p]]))
    if temperature == 0:
        assert torch.equal(out.logits[0, 0].argmax(-1), draft.tokens[0])
    else:
        torch.testing.assert_close(torch.softmax(out.logits[0, 0] / temperature, -1), draft.probs[0])
    torch.testing.assert_close(torch.sigmoid(out.confidence_logits[0, 0]), draft.confidence[0])


def test_embedding_and_head_are_the_targets_frozen_and_not_saved(target, drafter, tmp_path):
    assert drafter._io()[0] is target.model.embed_tokens and drafter._io()[1] is target.lm_head
    own = {id(p) for p in drafter.parameters()}
    assert id(target.lm_head.weight) not in own and id(target.model.embed_tokens.weight) not in own
    assert not target.lm_head.weight.requires_grad
    ids = torch.randint(0, 256, (1, 12))
    drafter(ids, _features(target, ids), torch.tensor([[2, 6]])).logits.sum().backward()
    assert target.lm_head.weight.grad is None and drafter.fc.weight.grad is not None
    drafter.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    assert {"markov_embed.weight", "markov_proj.weight", "confidence_head.weight", "confidence_head.bias"} <= keys


def test_save_load_roundtrip_through_auto_classes(target, drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path, trust_remote_code=False).model_type == "dspark"
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=False)
    assert isinstance(loaded, DSparkDrafter)
    loaded.bind_target(target)
    ids = torch.randint(0, 256, (1, 12))
    feats = _features(target, ids)
    a = torch.tensor([[3]])
    torch.testing.assert_close(loaded(ids, feats, a).logits, drafter(ids, feats, a).logits, rtol=0, atol=0)


def test_loading_a_mismatched_checkpoint_names_the_tensors(drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    tiny_drafter_config(markov_rank=16).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="markov_embed.weight"):
        DSparkDrafter.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        DSparkDrafter.from_pretrained(tmp_path / "nowhere")


def test_unbound_drafter_and_final_layer_capture_raise(target):
    d = DSparkDrafter(tiny_drafter_config())
    with pytest.raises(RuntimeError, match="bind_target"):
        d(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, 128), torch.tensor([[0]]))
    with pytest.raises(ValueError, match="final layer 3"):
        TargetFeatureCapture(target, [0, 3])


def test_rank_zero_drafter_has_no_markov_head(target):
    d = DSparkDrafter(tiny_drafter_config(markov_rank=0))
    d.bind_target(target)
    assert d.markov_embed is None and d.confidence_head.in_features == 64
    ids = torch.randint(0, 256, (1, 10))
    assert d(ids, _features(target, ids), torch.tensor([[1]])).logits.shape == (1, 1, 4, 320)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_draft_is_the_slot_by_slot_chain(target, drafter, backend):
    """An all-greedy batch drafts through the fused Markov chain (`markov_chain_greedy`, the backend the engine
    forces); it gives the tokens and confidences of the slot-by-slot loop the sampled path keeps."""
    torch.manual_seed(5)
    n, p, g = 3, 9, drafter.config.block_size
    with torch.no_grad():
        drafter.markov_proj.weight.normal_(0.0, 0.5)  # a Markov correction strong enough to change tokens
    drafter.set_backends(BackendChoice(kernels=backend))
    assert drafter.norm.backends.kernels == backend
    ids = torch.randint(0, 256, (n, p + 1))
    anchors, positions, valid = ids[:, p], torch.full((n,), p), torch.ones(n, p, dtype=torch.bool)
    ctx_pos = torch.arange(p).expand(n, p)
    ctx = drafter.context_keys_values(_features(target, ids)[:, :p], ctx_pos)
    draft = drafter.draft(anchors, positions, SlotContext(ctx, torch.arange(n), positions), g, [0.0] * n, [None] * n)
    block = torch.full((n, g), drafter.config.mask_token_id)
    block[:, 0] = anchors
    hidden = drafter.backbone(block, positions, ctx, ctx_pos, valid)
    base = target.lm_head(hidden).float()
    tokens, _, conf = drafter._draft_chain(anchors, hidden, base, [], [0.0] * n, [None] * n, False)
    assert torch.equal(draft.tokens, tokens)
    torch.testing.assert_close(draft.confidence, conf)
    assert torch.equal(draft.probs, torch.nn.functional.one_hot(tokens, drafter.config.vocab_size).float())
