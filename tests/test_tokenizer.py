import json
import random

import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from kimi_helix.tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    TokenizerLoadError,
    _byte_alphabet,
    build_byte_tokenizer,
    load_tokenizer,
)

SAMPLES = [
    "",
    "The capital of France is",
    "  leading and trailing spaces  ",
    "tabs\tnew\nlines\r\nand a NUL \x00 and DEL \x7f",
    "Héllo wörld, naïve café",
    "日本語のテキスト, 中文, 한국어",
    "emoji 🙂👍🏽 and a ZWJ family 👨‍👩‍👧",
    "math ∑ x² ≤ ∞, arrows →⇒",
]


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def test_layout(tok):
    assert len(tok) == 259
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID)
    assert (BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID) == (256, 257, 258)
    assert sorted(_byte_alphabet()) == sorted(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("text", SAMPLES)
def test_ids_are_the_utf8_bytes_and_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # no special tokens added, no prefix space
    assert tok.decode(ids) == text


def test_random_text_round_trips(tok):
    rng = random.Random(0)
    # Any code point but the surrogates, which UTF-8 cannot encode.
    points = [*range(1, 0xD800), *range(0xE000, 0x110000)]
    for _ in range(200):
        text = "".join(chr(rng.choice(points)) for _ in range(rng.randint(1, 40)))
        ids = tok(text)["input_ids"]
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_every_byte_decodes_as_itself(tok):
    for b in range(256):
        assert tok.decode([b]) == bytes([b]).decode("utf-8", errors="replace")


def test_special_tokens_in_text(tok):
    ids = tok("a<|eos|>b")["input_ids"]
    assert ids == [97, EOS_TOKEN_ID, 98]
    assert tok.decode(ids) == "a<|eos|>b"
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_decode_skips_ids_it_lacks_and_bad_utf8(tok):
    # A random model with vocab_size 320 emits ids 259..319; they must not crash decoding.
    assert tok.decode([72, 105, 259, 300, 319, 10_000]) == "Hi"
    assert tok.decode([0xC3]) == "\ufffd"  # a truncated 2-byte sequence


def test_save_and_load_with_auto_tokenizer(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tok)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (256, 257, 258)
    for text in SAMPLES:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == text


def test_load_tokenizer_loads_a_saved_folder(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded("héllo")["input_ids"] == tok("héllo")["input_ids"]


def _with_code(tok, folder, file: str, auto_map: dict) -> None:
    """Save `tok` in `folder`, then point `file`'s auto_map at a module that would write folder/PWNED."""
    tok.save_pretrained(folder)
    data = json.loads((folder / file).read_text()) if (folder / file).is_file() else {}
    (folder / file).write_text(json.dumps({**data, "auto_map": auto_map}))
    (folder / "tokenization_evil.py").write_text("open(__file__.replace('tokenization_evil.py', 'PWNED'), 'w')\n")


@pytest.mark.parametrize(
    ("file", "auto_map"),
    [
        ("tokenizer_config.json", {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}),
        ("tokenizer_config.json", ["tokenization_evil.EvilTokenizer"]),
        ("config.json", {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}),
    ],
)
def test_load_tokenizer_refuses_folder_code(tok, tmp_path, monkeypatch, file, auto_map):
    _with_code(tok, tmp_path, file, auto_map)
    monkeypatch.setattr("sys.stdin", None)  # nothing may ask: reading stdin would fail
    with pytest.raises(TokenizerLoadError, match=rf"{file} has an auto_map .*trust_remote_code=False"):
        load_tokenizer(tmp_path)
    assert not (tmp_path / "PWNED").exists()


def test_load_tokenizer_allows_a_config_auto_map_for_the_model_only(tok, tmp_path):
    # Kimi-Linear's config.json maps AutoConfig/AutoModel to its own code; that does not concern the tokenizer.
    _with_code(tok, tmp_path, "config.json", {"AutoConfig": "configuration_kimi.KimiLinearConfig"})
    assert load_tokenizer(tmp_path)("a")["input_ids"] == [97]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "does not load"),
        (lambda d: (d / "tokenizer_config.json").write_text("{not json"), "tokenizer_config.json is not valid JSON"),
    ],
    ids=["empty-folder", "bad-json"],
)
def test_load_tokenizer_errors_name_the_folder(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(TokenizerLoadError, match=message) as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value)
