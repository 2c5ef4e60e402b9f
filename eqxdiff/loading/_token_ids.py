"""Text into token ids the one way every prompt and caption is cut and padded (diffusers' pipelines' and training
scripts' ``padding="max_length", truncation=True``): the pipelines' prompts (``pipelines/_text.py``, which adds the
warnings), training captions (``data``) and the trainer's null prompts (``train``) all call :func:`token_ids`."""

from collections.abc import Sequence

import numpy as np


def token_ids(tokenizer, texts: Sequence[str], length: int | None = None, *,
              mask: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """int32 token ids ``[len(texts), length]`` (default length: the tokenizer's ``model_max_length``), each text cut
    to ``length`` (keeping its end token) and padded; with ``mask=True`` also the attention mask (int32: 1 for a
    text's tokens, 0 for padding). Silent: the pipelines warn about cut prompts themselves."""
    length = tokenizer.model_max_length if length is None else int(length)
    call = dict(padding="max_length", max_length=length, truncation=True)  # one setting for every call: the
    # tokenizer's backend keeps it as state, and grain's threads tokenize captions with one tokenizer at once
    try:
        out = tokenizer(list(texts), **call, return_attention_mask=mask, return_tensors="np")
        fits = np.shape(out.input_ids)[-1] == length
    except ValueError:  # a ragged batch: rows that truncation could not cut to length
        fits = False
    if not fits:
        # truncation cannot cut below the special tokens every text gets (bos and/or eos)
        specials = int(np.sum(tokenizer([""], **call, return_attention_mask=True).attention_mask[0]))
        if length < max(specials, 1):
            raise ValueError(f"a token length of {length} is too short: the tokenizer adds {specials} special "
                             f"token(s) to every text; ask for at least {max(specials, 1)} (max_sequence_length)")
        out = tokenizer(list(texts), **call, return_attention_mask=mask, return_tensors="np")  # its own error
    ids = np.asarray(out.input_ids, np.int32)
    return (ids, np.asarray(out.attention_mask, np.int32)) if mask else ids
