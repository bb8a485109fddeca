"""A byte-level tokenizer that needs no download: token id `b` is the byte `b`, then three special tokens.

It is a `tokenizers` BPE model with no merges over GPT-2's byte-to-unicode alphabet: the `ByteLevel` pre-tokenizer
maps every input byte to one alphabet character and the `ByteLevel` decoder maps the characters back, so any UTF-8
text round-trips exactly. It saves with `save_pretrained` and loads with `AutoTokenizer.from_pretrained`.

`load_tokenizer(path)` is the one place kimi_helix loads a tokenizer from a folder: it never runs the folder's code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:  # transformers is imported by the functions that need it: `presets` reads only the ids below
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

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
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


class TokenizerLoadError(ValueError):
    """A folder's tokenizer cannot be loaded without running code from it, or does not load at all."""


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in the folder `path` without running any code from it.

    A folder that asks for its own Python code (an `auto_map` in `tokenizer_config.json`, or an `AutoTokenizer`
    entry in the `auto_map` of `config.json`) is refused before transformers reads it, so no `[y/N]` prompt is shown
    and stdin is never read; the load itself passes `trust_remote_code=False` as a second guard. Raises
    `TokenizerLoadError` naming the file and the reason.
    """
    path = Path(path)
    for name, key in (("tokenizer_config.json", None), ("config.json", "AutoTokenizer")):
        auto_map = _json_field(path / name, "auto_map")
        if auto_map is not None and (key is None or not isinstance(auto_map, dict) or key in auto_map):
            raise TokenizerLoadError(
                f"{path / name} has an auto_map that points at Python code in the folder ({auto_map!r}); kimi_helix "
                "runs no code from a checkpoint (trust_remote_code=False). Load a tokenizer you trust yourself and "
                "pass it in (LLM(..., tokenizer=...)), or use a folder whose tokenizer is data only (no auto_map)"
            )
    from transformers import AutoTokenizer

    import kimi_helix

    kimi_helix.register_auto_classes()  # AutoTokenizer reads config.json: our model types must be known to it
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as err:
        raise TokenizerLoadError(f"the tokenizer in {path} does not load (no remote code is run): {err}") from err


def _json_field(file: Path, field: str):
    """`field` of the JSON object in `file`; None when the file is absent or has no such field."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise TokenizerLoadError(f"{file} is not valid JSON: {err}") from err
    return data.get(field) if isinstance(data, dict) else None
