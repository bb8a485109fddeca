"""A byte-level tokenizer that needs no download: token id `b` is the byte `b`, then three special tokens.

It is a `tokenizers` BPE model with no merges over GPT-2's byte-to-unicode alphabet: the `ByteLevel` pre-tokenizer
maps every input byte to one alphabet character and the `ByteLevel` decoder maps the characters back, so any UTF-8
text round-trips exactly. It saves with `save_pretrained` and loads with `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 256, 257, 258


def _byte_alphabet() -> list[str]:
    """The character `ByteLevel` writes for each byte 0..255 (GPT-2's `bytes_to_unicode`).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes take code points 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 256 + 256 - len(printable)))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Return the byte tokenizer: ids 0..255 are bytes, 256 `<|bos|>`, 257 `<|eos|>`, 258 `<|pad|>` (259 tokens).

    Encoding adds no special tokens. Decoding skips ids the tokenizer does not have (a random model with a larger
    vocabulary emits them) and writes U+FFFD for byte sequences that are not valid UTF-8.
    """
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in enumerate(_byte_alphabet())}, merges=[]))
    tok.add_special_tokens([BOS_TOKEN, EOS_TOKEN, PAD_TOKEN])  # in id order: 256, 257, 258
    # No regex split and no prefix space: the pre-tokenizer must only relabel bytes, never add or regroup them.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
