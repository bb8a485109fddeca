"""A tiny random checkpoint with the byte tokenizer, shared by the eval tests."""

import pytest
import torch

from kimi_helix import KimiK3Config, KimiK3ForCausalLM
from kimi_helix.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, build_byte_tokenizer

from ..modeling.conftest import tiny_kwargs


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Folder of a random fp32 `tiny` model (vocab = the byte tokenizer's 259 ids + 1) and its tokenizer."""
    folder = tmp_path_factory.mktemp("tiny_ckpt")
    torch.manual_seed(0)
    config = KimiK3Config(
        **tiny_kwargs(vocab_size=260, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    )
    KimiK3ForCausalLM(config).eval().save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder
