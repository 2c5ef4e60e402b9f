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
    specials = len(tokenizer("", verbose=False).input_ids)  # what every text gets: bos and/or eos
    if length < max(specials, 1):
        # truncation cannot cut below them: the tokenizer would return longer rows (or fail on a ragged batch)
        raise ValueError(f"a token length of {length} is too short: the tokenizer adds {specials} special token(s) "
                         f"to every text; ask for at least {max(specials, 1)} (max_sequence_length)")
    out = tokenizer(list(texts), padding="max_length", max_length=length, truncation=True,
                    return_attention_mask=mask, return_tensors="np")
    ids = np.asarray(out.input_ids, np.int32)
    return (ids, np.asarray(out.attention_mask, np.int32)) if mask else ids
