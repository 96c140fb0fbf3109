"""build_vocabulary: token bytes, special-token exclusion and real guides over SmolLM2's vocab."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from radixlm.runtime.constrained.vocabulary import (
    build_vocabulary,
    byte_level_to_bytes,
    detect_style,
    sentencepiece_to_bytes,
    unicode_to_byte,
)

VOCAB_SIZE = 49152
EOS = 2  # <|im_end|>
SPECIAL_IDS = range(17)  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name> ... <empty_output>


@pytest.fixture(scope="module")
def tok(smol_tokenizer):
    return smol_tokenizer


@pytest.fixture(scope="module")
def vocab(tok) -> Vocabulary:
    return build_vocabulary(tok, VOCAB_SIZE, [EOS])


def allowed_at_start(regex: str, vocabulary: Vocabulary) -> set[int]:
    return set(Guide(Index(regex, vocabulary)).get_tokens())


def walk(regex: str, vocabulary: Vocabulary, ids: Sequence[int], eos: int = EOS) -> Guide:
    """Advance a guide through ``ids``, checking each was allowed; ends accepted with EOS allowed."""
    guide = Guide(Index(regex, vocabulary))
    for step, token_id in enumerate(ids):
        allowed = guide.get_tokens()
        assert token_id in allowed, f"token {token_id} rejected at step {step}"
        assert (eos in allowed) == guide.is_finished()  # EOS only in accepting states
        guide.advance(token_id, return_tokens=False)
    assert guide.is_finished()
    assert eos in guide.get_tokens()
    return guide


def tiny_tokenizer(vocab: dict[str, int], decoder: decoders.Decoder, eos: str) -> PreTrainedTokenizerFast:
    """A real HF fast tokenizer over a hand-written vocab, built offline."""
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos)


# --- keys are the bytes a token adds to the text ----------------------------------------------


def test_smollm2_is_byte_level_and_keys_are_raw_bytes(tok, vocab):
    assert detect_style(tok, tok.get_vocab()) == "byte_level"
    assert vocab.get(b" ") == [tok.convert_tokens_to_ids("Ġ")]
    assert vocab.get(b"\n") == [tok.convert_tokens_to_ids("Ċ")]
    assert vocab.get(b" the") == [tok.convert_tokens_to_ids("Ġthe")]
    assert vocab.get("Ġthe".encode()) is None  # the vocab string itself is not a key


def test_byte_level_table_round_trips_every_byte():
    table = unicode_to_byte()
    assert sorted(table.values()) == list(range(256))
    assert byte_level_to_bytes("ĠĊ\u0100") == b" \n\x00"
    assert byte_level_to_bytes("æĹ¥") == "日".encode()
    assert byte_level_to_bytes("a b") == b"a b"  # unmapped chars (added tokens) keep their UTF-8


def test_sentencepiece_token_bytes():
    assert sentencepiece_to_bytes("▁12") == b" 12"
    assert sentencepiece_to_bytes("<0x0A>") == b"\n"
    assert sentencepiece_to_bytes("<0xE6>") == b"\xe6"
    assert sentencepiece_to_bytes("日本") == "日本".encode()


# --- leading spaces --------------------------------------------------------------------------


def test_space_token_allowed_only_where_regex_has_a_space(tok, vocab):
    space, space_the = tok.convert_tokens_to_ids(["Ġ", "Ġthe"])
    digits = set(tok.convert_tokens_to_ids(list("0123456789")))
    assert allowed_at_start(r"[0-9]+", vocab) == digits
    assert allowed_at_start(r" [0-9]+", vocab) == {space}  # SmolLM2 has no 'Ġ<digit>' tokens
    assert space_the in allowed_at_start(r" [a-z]+", vocab)
    assert space_the not in allowed_at_start(r"[a-z]+", vocab)


def test_space_prefixed_multi_char_token_byte_level():
    tok = tiny_tokenizer({"<eos>": 0, "1": 1, "2": 2, "Ġ12": 3, "Ġ": 4, "12": 5}, decoders.ByteLevel(), "<eos>")
    vocab = build_vocabulary(tok, 6, [0])
    assert vocab.get(b" 12") == [3]
    assert allowed_at_start(r"[0-9]+", vocab) == {1, 2, 5}
    assert allowed_at_start(r" [0-9]+", vocab) == {3, 4}


@pytest.mark.parametrize("decoder", [
    decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]),
    decoders.Metaspace(),
])
def test_sentencepiece_tokenizer(decoder):
    vocab_map = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁12": 3, "<0x0A>": 4, "1": 5, "▁": 6, "<0x41>": 7, "A": 8}
    tok = tiny_tokenizer(vocab_map, decoder, "</s>")
    assert detect_style(tok, tok.get_vocab()) == "sentencepiece"
    vocab = build_vocabulary(tok, len(vocab_map), [2])
    assert vocab.get(b" 12") == [3]
    assert vocab.get(b"\n") == [4]
    assert vocab.get(b"A") == [7, 8]  # byte-fallback and plain token share one key
    assert allowed_at_start(r"[0-9]+", vocab) == {5}
    assert allowed_at_start(r" [0-9]+", vocab) == {3, 6}
    walk(r"A\n", vocab, [8, 4], eos=2)


# --- special tokens, EOS and vocab_size ------------------------------------------------------


def test_special_tokens_never_allowed_eos_only_when_final(tok, vocab):
    guide = Guide(Index(r"[a-z]{2}", vocab))
    for letter in ("a", "b", None):
        allowed = set(guide.get_tokens())
        assert not allowed & (set(SPECIAL_IDS) - {EOS})
        assert (EOS in allowed) == guide.is_finished()
        if letter is not None:
            guide.advance(tok.convert_tokens_to_ids(letter), return_tokens=False)
    assert set(guide.get_tokens()) == {EOS}


def test_special_token_text_is_not_a_key(vocab):
    for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"):
        assert vocab.get(text.encode()) is None


def test_ids_beyond_vocab_size_are_dropped(tok):
    small = build_vocabulary(tok, 1000, [EOS])
    assert max(allowed_at_start(r"[a-z ]+", small)) < 1000


def test_eos_is_required(tok):
    with pytest.raises(ValueError):
        build_vocabulary(tok, VOCAB_SIZE, [])


# --- guides over real encodings --------------------------------------------------------------


def test_date_regex_accepts_encoded_date(tok, vocab):
    walk(r"\d{4}-\d{2}-\d{2}", vocab, tok.encode("2024-11-30"))


def test_json_schema_regex_accepts_encoded_json(tok, vocab):
    schema = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
    regex = build_regex_from_schema(schema)
    assert "[ ]?" in regex  # outlines-core allows at most one plain space between JSON tokens
    walk(regex, vocab, tok.encode('{"a": 12}'))
    walk(regex, vocab, tok.encode('{"a":12}'))
    guide = Guide(Index(regex, vocab))
    assert not guide.accepts_tokens(tok.encode('{"a": "12"}'))


def test_multibyte_characters_split_across_tokens(tok, vocab):
    ids = tok.encode("日本")
    assert len(ids) > 2  # '日' is split into two byte-level tokens
    walk("é+|日本", vocab, ids)
    walk("é+|日本", vocab, tok.encode("éé"))
