"""The DSpark drafter: slot convention, context visibility, drafting = teacher forcing, checkpoints, sharing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModel

from kimi_helix.modeling import CheckpointError
from kimi_helix.speculative.dspark import DSparkDrafter, TargetFeatureCapture

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
    draft = drafter.draft(
        ids[:, p], torch.tensor([p]), ctx, torch.ones(1, p, dtype=torch.bool), g, [temperature], [gen]
    )
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
