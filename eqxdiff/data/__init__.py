"""Data sources and input pipelines."""

from ._tokenizer import character_tokenizer as character_tokenizer
