"""Offline outlines-core ``Vocabulary`` for a loaded Hugging Face tokenizer.

outlines-core matches a regex against the *bytes* a token contributes to the
generated text, so every vocabulary entry must be keyed by those raw bytes, not
by the token's string in the tokenizer's vocab (``'Ġ12'`` means ``b' 12'``,
``'<0x0A>'`` means ``b'\\n'``). ``Vocabulary.from_pretrained`` does this but
downloads the tokenizer from the Hub; here we start from the tokenizer the
server already loaded.

How the pieces fit together in the sampler (``outlines_core.kernels.torch``)::

    vocabulary = build_vocabulary(tokenizer, vocab_size, eos_ids)  # once per model
    index = Index(regex, vocabulary)      # once per regex; compiling is the slow part, cache it
    guide = Guide(index)                  # once per request; cheap, holds the DFA state
    mask = allocate_token_bitmask(vocab_size)  # int32 [1, ceil(V / 32)], pinned CPU when CUDA exists
    # every decode step, for that request's row i of the logits:
    fill_next_token_bitmask(guide, mask)  # CPU, batch dim 1, contiguous; bit set = token allowed
    apply_token_bitmask_inplace(logits[i:i + 1], mask.to(logits.device, non_blocking=True))
    # ... sample token from logits[i] ..., then
    guide.advance(token, return_tokens=False)

For a batch, allocate one ``[B, W]`` mask, fill row views ``mask[i:i + 1]``
(each is contiguous) and apply it once to ``[B, V]`` logits; unconstrained rows
stay all ones (``allocate_token_bitmask`` fills with -1). The apply kernel is
``torch.compile``d: its first call compiles. Columns past ``32 * W`` are set to
-inf and ids missing from the vocabulary (specials, ids >= vocab_size) have a
zero bit, so they are never sampled.

``guide.is_finished()`` means "in an accepting state", not "nothing else
allowed": ``[0-9]+`` is finished after one digit yet still allows more digits;
the EOS id is allowed exactly in accepting states. Constraints compiled with
the end mark (constraint_regex.END_MARK, working around an outlines-core 0.2
flaw) are the exception: their Index never allows EOS,
``outlines_backend.Grammar.can_end`` says where the text may end, and
``OutlinesMatcher.fill_mask`` allows EOS there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any

from outlines_core import Vocabulary

from radixlm.runtime.constrained.constraint_regex import END_MARK

SPIECE_SPACE = "\u2581"  # '▁', SentencePiece's visible stand-in for a space
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback token, e.g. '<0x0A>'

TokenToBytes = Callable[[str], bytes]


def build_vocabulary(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Vocabulary:
    """An outlines-core Vocabulary built offline from a loaded HF tokenizer.

    Keys are each token's raw bytes as it appears in generated text: byte-level
    BPE (GPT-2 style, ``'Ġ'`` = space) is mapped back through the
    bytes-to-unicode table; SentencePiece-style (``'▁'`` = space, ``'<0x0A>'``
    byte-fallback tokens) too. A SentencePiece token keeps its leading space:
    mid-text that is what it adds (the decoder only strips it at the very start).

    Special tokens (``all_special_ids``, added tokens marked special), every EOS
    id and ids >= ``vocab_size`` are left out, so a guide never allows them.
    Tokens that map to the same bytes share one key. ``eos_token_ids[0]`` is
    the Vocabulary's EOS, which outlines-core allows only in accepting states;
    other EOS ids are never allowed by a guide.
    """
    if not eos_token_ids:
        raise ValueError("build_vocabulary needs at least one EOS token id")
    return vocabulary_from_bytes(token_bytes(tokenizer, vocab_size, eos_token_ids), eos_token_ids[0])


def vocabulary_from_bytes(table: Sequence[bytes | None], eos_token_id: int) -> Vocabulary:
    """The Vocabulary of a `token_bytes` table (tokens with the same bytes share one key), plus the
    end mark's token, id `len(table)` (see constraint_regex.END_MARK); real tokens holding the mark's
    byte (a NUL: no text a constraint should produce) are left out."""
    groups: dict[bytes, list[int]] = {END_MARK: [end_token_id(table)]}
    for token_id, raw in enumerate(table):
        if raw and END_MARK not in raw:  # an empty token would let the guide loop in place forever
            groups.setdefault(raw, []).append(token_id)  # ids ascend: the Vocabulary is deterministic
    return Vocabulary(eos_token_id, groups)


def end_token_id(table: Sequence[bytes | None]) -> int:
    """The end mark's token id for a `token_bytes` table: one past the model's vocabulary."""
    return len(table)


def token_bytes(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> list[bytes | None]:
    """Every id's raw bytes in generated text; None for ids a guide never allows (specials, EOS, absent)."""
    vocab = tokenizer.get_vocab()
    to_bytes = token_decoder(detect_style(tokenizer, vocab))
    excluded = special_token_ids(tokenizer) | set(eos_token_ids)
    table: list[bytes | None] = [None] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size and token_id not in excluded:
            table[token_id] = to_bytes(token)
    return table


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of special tokens: the named ones plus added tokens flagged special.

    ``all_special_ids`` alone misses e.g. SmolLM2's ``<repo_name>`` (id 3..16),
    which are added tokens with ``special=True`` but no named role.
    """
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(token_id for token_id, token in added.items() if getattr(token, "special", False))
    return ids


def detect_style(tokenizer: Any, vocab: dict[str, int]) -> str:
    """How vocab strings encode bytes: ``"byte_level"``, ``"sentencepiece"`` or ``"plain"``.

    The backend's decoder is authoritative (it is what turns tokens into text);
    without one we fall back on the vocab's telltale characters.
    """
    decoder = _decoder_spec(tokenizer)
    if decoder is not None:
        return _style_from_decoder(decoder)
    if any(SPIECE_SPACE in token for token in vocab):
        return "sentencepiece"
    if "\u0120" in vocab or hasattr(tokenizer, "byte_encoder"):  # 'Ġ' alone is GPT-2's space token
        return "byte_level"
    return "plain"


def _decoder_spec(tokenizer: Any) -> dict[str, Any] | None:
    """The ``tokenizers`` decoder of a fast tokenizer as JSON, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    return json.loads(decoder.__getstate__())


def _style_from_decoder(decoder: dict[str, Any]) -> str:
    """Classify a decoder JSON, looking inside ``Sequence`` decoders."""
    kinds = set()
    for step in _decoder_steps(decoder):
        kind = step.get("type")
        if kind == "Replace" and step.get("pattern", {}).get("String") == SPIECE_SPACE:
            kind = "Metaspace"  # Llama-2 style: Replace('▁', ' ') + ByteFallback + Fuse + Strip
        kinds.add(kind)
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"Metaspace", "ByteFallback"}:
        return "sentencepiece"
    return "plain"


def _decoder_steps(decoder: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Flatten nested ``Sequence`` decoders into their steps."""
    if decoder.get("type") == "Sequence":
        for step in decoder.get("decoders", []):
            yield from _decoder_steps(step)
    else:
        yield decoder


def token_decoder(style: str) -> TokenToBytes:
    """The function mapping a vocab string to its raw bytes for ``style``."""
    decoders: dict[str, TokenToBytes] = {
        "byte_level": byte_level_to_bytes,
        "sentencepiece": sentencepiece_to_bytes,
        "plain": lambda token: token.encode("utf-8"),
    }
    return decoders[style]


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes-to-unicode table.

    Byte-level BPE shows each byte as one printable character: bytes that are
    already printable (and not space) stand for themselves, the remaining 68
    are shifted, in byte order, to code points 256, 257, ... ('Ġ' = 256 + 32).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


def byte_level_to_bytes(token: str) -> bytes:
    """Raw bytes of a byte-level BPE token.

    A character outside the table (found in non-special added tokens, which are
    stored verbatim) is kept as its UTF-8, as the ByteLevel decoder does.
    """
    table = unicode_to_byte()
    out = bytearray()
    for char in token:
        byte = table.get(char)
        if byte is None:
            out += char.encode("utf-8")
        else:
            out.append(byte)
    return bytes(out)


def sentencepiece_to_bytes(token: str) -> bytes:
    """Raw bytes of a SentencePiece token: ``<0xNN>`` is one byte, ``'▁'`` is a space."""
    match = _BYTE_FALLBACK.fullmatch(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace(SPIECE_SPACE, " ").encode("utf-8")
