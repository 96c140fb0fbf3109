"""Tiny tokenizers with the special-token rules of real ones, trained here on a few lines (nothing
downloaded): Llama 3's (a BOS before every encoded text, and a chat template that writes its own)
and Qwen3-Embedding's (an `<|endoftext|>` after every encoded text, which last-token pooling reads).
Byte-level BPE, as both models' are."""

from __future__ import annotations

CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the answer? Let me think about it.",
    "Hello world, hello there. Colour: red, blue, green. The capital of France is Paris.",
]
# Meta-Llama-3-8B-Instruct's chat template, as published
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def train_bpe(special: list[str], vocab_size: int, corpus: list[str] = CORPUS):
    """A byte-level BPE trained on `corpus` here (nothing downloaded), `special` its first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus * 4, trainer)
    return bpe


def llama3_tokenizer(vocab_size: int = 320):
    """BOS `<|begin_of_text|>` (id 0) before every text it encodes with its special tokens."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bpe = train_bpe(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                    vocab_size)
    bpe.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def embedding_tokenizer(vocab_size: int = 320):
    """Qwen3-Embedding's rule: `<|endoftext|>` (id 0) after every text it encodes with its special tokens."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bpe = train_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], vocab_size)
    bpe.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>", special_tokens=[("<|endoftext|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
