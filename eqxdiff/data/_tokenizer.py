"""A character-level CLIP tokenizer: built offline, so small models (tests, the digits model) need no download."""

from ..core import import_transformers

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def character_tokenizer(max_length: int = 16):
    """A ``transformers.CLIPTokenizer`` over lowercase letters (each word's last letter ends with ``</w>``, as
    CLIP's BPE marks word ends); ``<|startoftext|>`` = 0, ``<|endoftext|>`` = 1 (also padding)."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in LETTERS:
        vocab[c] = len(vocab)
    for c in LETTERS:
        vocab[c + "</w>"] = len(vocab)
    return import_transformers().CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)
