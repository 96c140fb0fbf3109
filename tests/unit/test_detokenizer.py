"""Incremental detokenization against the real SmolLM2 tokenizer (GPT-2 style byte-level BPE)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from radixlm.runtime.tokenizer.detokenizer import IncrementalDetokenizer

ASCII = "The quick brown fox jumps over the lazy dog. It's 42 degrees, isn't it?\n  Indented  line\twith tabs."
MULTIBYTE = "Café crème, naïve façade 😀🎉👍🏽 日本語のテキスト 한국어 Ελληνικά — “quotes” ∑∫√ 🇫🇷!"


@pytest.fixture(scope="module")
def tok(smol_tokenizer):
    return smol_tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int] | None = None) -> list[str]:
    """Feed ids in the given chunk sizes (one at a time by default), flushing at the end; return the deltas."""
    deltas, start = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.add(ids[start:start + size]))
        start += size
    deltas.append(detok.add(ids[start:], flush=True))
    assert "".join(deltas) == detok.text
    return deltas


def random_chunks(n: int, seed: int) -> list[int]:
    rng, sizes = random.Random(seed), []
    while sum(sizes) < n:
        sizes.append(min(rng.randint(1, 7), n - sum(sizes)))
    return sizes


def test_ascii_one_token_at_a_time_matches_full_decode(tok):
    ids = encode(tok, ASCII)
    detok = IncrementalDetokenizer(tok)
    deltas = feed(detok, ids)
    assert detok.text == tok.decode(ids, skip_special_tokens=True) == ASCII
    assert sum(1 for d in deltas if d) >= len(ids) - 1  # streamed as it goes, not all at the flush


@pytest.mark.parametrize("seed", range(5))
def test_random_chunk_sizes_match_full_decode(tok, seed):
    ids = encode(tok, ASCII + MULTIBYTE)
    detok = IncrementalDetokenizer(tok)
    feed(detok, ids, random_chunks(len(ids), seed))
    assert detok.text == tok.decode(ids) == ASCII + MULTIBYTE


def test_multibyte_characters_are_never_emitted_half(tok):
    ids = encode(tok, MULTIBYTE)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "text must split characters across tokens"
    detok = IncrementalDetokenizer(tok)
    deltas = feed(detok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert detok.text == tok.decode(ids) == MULTIBYTE


def test_leading_space_of_first_output_token_with_prompt_context(tok):
    prompt = encode(tok, "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    for text in (" Hello there", "Hello there", "  two spaces", "😀 first"):
        out = encode(tok, text)
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
        feed(detok, out)
        full = tok.decode(prompt + out)
        assert detok.text == tok.decode(out) == full[len(tok.decode(prompt)):] == text


def test_prompt_ending_mid_character_does_not_swallow_output(tok):
    ids = encode(tok, "日本")
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    out = ids[split:] + encode(tok, " ok")
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:split])
    feed(detok, out)
    # the orphaned continuation bytes decode as decode(out) has them; the rest is not lost
    assert detok.text == tok.decode(out) and detok.text.endswith("本 ok")


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens_skipped_or_kept(tok, skip, spaces):
    ids = encode(tok, "<|im_start|>assistant\nSure<|im_end|><|im_start|>x<|endoftext|>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    feed(detok, ids)
    assert detok.text == tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert ("<|im_end|>" in detok.text) is not skip


def test_stop_string_spanning_tokens_never_leaks(tok):
    stop = " the lazy dog"
    ids = encode(tok, ASCII)
    assert len(encode(tok, stop)) >= 3
    expected = ASCII[:ASCII.index(stop)]
    detok = IncrementalDetokenizer(tok, stop=[stop])
    for i in ids:
        detok.add([i])
        assert expected.startswith(detok.text)  # never a single character past the cut
    assert detok.add([], flush=True) == ""
    assert detok.text == expected
    assert detok.stopped_on == stop


def test_keep_stop_ends_the_text_with_the_stop_string(tok):
    stop = " the lazy dog"
    detok = IncrementalDetokenizer(tok, stop=[stop], keep_stop=True)
    deltas = feed(detok, encode(tok, ASCII))
    assert "".join(deltas) == detok.text == ASCII[:ASCII.index(stop) + len(stop)]
    assert detok.stopped_on == stop


def test_partial_stop_match_then_divergence_releases_held_text(tok):
    detok = IncrementalDetokenizer(tok, stop=["Hello"])
    first = detok.add(encode(tok, "Say Hel"))
    assert first == "Say "  # "Hel" may begin the stop string: held
    assert detok.add(encode(tok, "p")) == "Help"
    assert detok.add(encode(tok, " me"), flush=True) == " me"
    assert detok.text == "Say Help me" and detok.stopped_on is None


def test_stop_at_the_very_first_token(tok):
    ids = encode(tok, "Hello world")
    detok = IncrementalDetokenizer(tok, stop=["Hello"])
    assert detok.add(ids[:1]) == ""
    assert detok.stopped_on == "Hello" and detok.text == ""
    assert detok.add(ids[1:], flush=True) == ""


def test_earliest_of_several_stop_strings_wins(tok):
    ids = encode(tok, "one two three four")
    detok = IncrementalDetokenizer(tok, stop=["four", "two", "thr"])
    feed(detok, ids, [len(ids)])  # all in one chunk: both "two" and "thr" are present
    assert detok.text == "one " and detok.stopped_on == "two"


def test_flush_releases_held_tail(tok):
    detok = IncrementalDetokenizer(tok, stop=["</answer>"])
    assert detok.add(encode(tok, "42 </ans")) == "42 "
    assert detok.add([], flush=True) == "</ans"
    assert detok.text == "42 </ans" and detok.stopped_on is None


def test_tokens_after_a_stop_are_ignored(tok):
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    assert detok.add(encode(tok, "go STOP now")) == "go "
    assert detok.add(encode(tok, " more text")) == ""
    assert detok.add(encode(tok, " and more"), flush=True) == ""
    assert detok.text == "go " and detok.stopped_on == "STOP"


class RecordingTokenizer:
    """Delegates to a tokenizer, remembering how many ids each decode call got and with which options."""

    def __init__(self, tok) -> None:
        self.tok, self.lengths, self.kwargs = tok, [], []

    def decode(self, ids, **kwargs) -> str:
        self.lengths.append(len(ids))
        self.kwargs.append(kwargs)
        return self.tok.decode(ids, **kwargs)


def test_per_step_decode_work_is_bounded(tok):
    ids = (encode(tok, ASCII + " " + MULTIBYTE + " ") * 60)[:2000]
    assert len(ids) == 2000
    recorder = RecordingTokenizer(tok)
    prompt = encode(tok, "Tell me a story.")
    detok = IncrementalDetokenizer(recorder, prompt_ids=prompt, skip_special_tokens=False,
                                   spaces_between_special_tokens=False, stop=["never appears"])
    feed(detok, ids)
    assert detok.text == tok.decode(ids)
    assert max(recorder.lengths) <= 10
    assert len(detok._ids) <= 10  # the window is all that is kept
    assert all(kw == {"skip_special_tokens": False, "spaces_between_special_tokens": False}
               for kw in recorder.kwargs)


@pytest.mark.parametrize("seed", range(3))
def test_replacing_emitted_ids_continues_the_text_exactly(tok, seed):
    """Jump-forward re-encodes already streamed ids with forced text after them: the text already
    emitted stays, and the deltas go on with exactly the new text."""
    rng = random.Random(seed)
    full = encode(tok, '{"name": "Café crème 😀", "tags": ["日本語", "x"], "n": 42}')
    for _ in range(40):
        cut = rng.randint(2, len(full) - 1)
        # the model wrote the text of full[cut-k:cut] in small pieces (one token per character)
        piece = tok.decode(full[cut - rng.randint(1, min(4, cut)):cut])
        old = [t for ch in piece for t in encode(tok, ch)][-8:]
        piece = tok.decode(old)
        head = full[:max(cut - 8, 0)]
        forced = tok.decode(full[cut:])[: rng.randint(1, 12)]
        detok = IncrementalDetokenizer(tok, prompt_ids=encode(tok, "Q:"), replaceable=8, stop=["never"])
        deltas = [detok.add(head[i:i + 3]) for i in range(0, len(head), 3)]
        deltas += [detok.add(old[i:i + 2]) for i in range(0, len(old), 2)]
        deltas.append(detok.replace(len(old), encode(tok, piece + forced), flush=True))
        assert "".join(deltas) == detok.text == tok.decode(head) + piece + forced
