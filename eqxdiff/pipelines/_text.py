"""Prompts into token ids, one way for every text encoder (CLIP, T5, UMT5 ...).

:func:`tokens` pads and cuts each prompt to a length (the tokenizer's ``model_max_length``, or a family's
``max_sequence_length``) and gives the attention mask beside the ids; it warns as diffusers' pipelines do when a
prompt is cut (naming the part cut off), and also when the tokenizer reads words as its unknown token, and checks
the ids against the text encoder's vocabulary (a tokenizer saved with another model fails here, not as garbage
embeddings). :func:`tokenize` is its ids alone. :func:`zero_padding` sets the embeddings past each prompt to zero, as
diffusers does for T5-family prompts it trims to their length and pads back to ``max_sequence_length`` (Wan's UMT5).
:func:`prompt_pair` is diffusers' ``encode_prompt`` for one text encoder: prompts or given embeddings, and the
negative ones of classifier-free guidance. The encoders themselves are each family's (CLIP skip, pooled outputs, which
hidden state).
"""

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._typing import Array, Bool, Float, Int, typechecked
from ..loading import CheckpointError, token_ids
from ._arguments import as_list
from ._checks import InputError, InputWarning

__all__ = ["Tokens", "prompt_pair", "tokenize", "tokens", "zero_padding"]

SHOWN_PROMPT = 40  # characters of a prompt quoted in a warning
SHOWN_TOKENS = 24  # tokens of the cut-off part decoded for a warning (then cut to SHOWN_PROMPT characters)


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Token ids ``[n, length]`` (int32) and their attention ``mask`` (int32: 1 for a prompt's tokens, its special
    tokens included; 0 for padding)."""

    ids: np.ndarray
    mask: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        """Each prompt's token count ``[n]`` (padding excluded; at most the length cut to)."""
        return self.mask.sum(axis=1)


def tokens(tokenizer, prompts: Sequence[str], *, max_length: int | None = None, vocab_size: int | None = None,
           tokenizer_name: str = "the tokenizer", encoder_name: str = "the text encoder",
           fix: str = "Shorten the prompt") -> Tokens:
    """``prompts`` as :class:`Tokens` of ``max_length`` (default: the tokenizer's ``model_max_length``), padded and
    cut as diffusers' pipelines do (``padding="max_length"``, ``truncation=True``).

    Warns (:class:`~eqxdiff.pipelines.InputWarning`) once per distinct prompt when it is cut (the count and the part
    cut off, then ``fix``) or holds words the tokenizer reads as its unknown token. With ``vocab_size`` (the text
    encoder's), an id outside the vocabulary raises :class:`~eqxdiff.loading.CheckpointError`. ``tokenizer_name`` /
    ``encoder_name`` name the two in those messages (``"tokenizer_2"``, ``"text_encoder_2"``)."""
    prompts = list(prompts)
    length = tokenizer.model_max_length if max_length is None else int(max_length)
    ids, mask = token_ids(tokenizer, prompts, length, mask=True)
    for prompt in dict.fromkeys(prompts):
        warn_cut(tokenizer, prompt, length, encoder_name=encoder_name, fix=fix)
        warn_unknown_words(tokenizer, prompt, tokenizer_name=tokenizer_name)
    if vocab_size is not None:
        check_vocabulary(ids, vocab_size, tokenizer_name=tokenizer_name, encoder_name=encoder_name)
    return Tokens(ids, mask)


def tokenize(tokenizer, prompts: Sequence[str], **kwargs) -> np.ndarray:
    """Token ids ``[n, length]`` (int32) of ``prompts``: :func:`tokens`' ids (same keywords, warnings and checks)."""
    return tokens(tokenizer, prompts, **kwargs).ids


def warn_cut(tokenizer, prompt: str, length: int, *, encoder_name: str = "the text encoder",
             fix: str = "Shorten the prompt") -> None:
    """Warn if ``prompt`` has more than ``length`` tokens, naming what is cut off (the tokens before the end token
    that truncation keeps), as diffusers' pipelines do."""
    full = tokenizer(prompt, truncation=False, verbose=False).input_ids
    if len(full) > length:
        cut = full[length - 1:-1]  # what truncation drops before the end token it keeps
        start = tokenizer.decode(cut[:SHOWN_TOKENS], skip_special_tokens=True).strip()
        more = len(cut) > SHOWN_TOKENS or len(start) > SHOWN_PROMPT
        if len(start) > SHOWN_PROMPT:  # whole words where there are any
            start = start[:SHOWN_PROMPT].rsplit(" ", 1)[0] if " " in start[:SHOWN_PROMPT] else start[:SHOWN_PROMPT]
        start = f"{start!r}{'...' if more else ''}" if start else "special or unknown tokens"
        warnings.warn(f"the prompt {_shown(prompt)} has {len(full)} tokens but {encoder_name} reads {length}: "
                      f"{len(cut)} token(s) were cut off, starting {start}. {fix}", InputWarning, stacklevel=3)


def warn_unknown_words(tokenizer, prompt: str, *, tokenizer_name: str = "the tokenizer") -> None:
    """Warn if ``prompt`` holds words the tokenizer reads as its unknown token (they reach the model as that one
    token: the model never sees them)."""
    unk = tokenizer.unk_token_id
    if unk is None or unk not in tokenizer(prompt, add_special_tokens=False, verbose=False).input_ids:
        return
    unknown = list(dict.fromkeys(
        w for w in prompt.split() if unk in tokenizer(w, add_special_tokens=False, verbose=False).input_ids))
    shown = ", ".join(repr(w if len(w) <= 20 else w[:20] + "...") for w in unknown[:3])
    shown += f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
    warnings.warn(f"{tokenizer_name} does not know {shown or 'part of the prompt'} in "
                  f"{_shown(prompt)} and reads {'it' if len(unknown) < 2 else 'them'} as "
                  f"{tokenizer.unk_token!r}; reword the prompt with words the model was trained on", InputWarning,
                  stacklevel=3)


def check_vocabulary(ids: np.ndarray, vocab_size: int, *, tokenizer_name: str = "the tokenizer",
                     encoder_name: str = "the text encoder") -> None:
    """Raise :class:`~eqxdiff.loading.CheckpointError` if a token id is outside ``[0, vocab_size)``: the tokenizer
    is not the one saved with the text encoder."""
    if not ids.size or (ids.max() < vocab_size and ids.min() >= 0):
        return
    bad = int(ids.max() if ids.max() >= vocab_size else ids.min())
    raise CheckpointError(f"{tokenizer_name} gave token id {bad}, outside {encoder_name}'s vocabulary of {vocab_size} "
                          f"(vocab_size in its config.json): {tokenizer_name} does not belong to {encoder_name}; use "
                          "the tokenizer saved with it")


@typechecked
def prompt_pair(encode: Callable[[Any, int], Any], given: Callable[[Any, str], Any], *, prompt, negative_prompt,
                prompt_embeds, negative_prompt_embeds, guided: bool, max_sequence_length: int,
                shape: Callable[[Any], tuple[int, ...]], same_length: bool = True) -> tuple[Any, Any | None]:
    """``(positive, negative)`` embeddings of one text encoder, the negative only when ``guided``, as diffusers'
    ``encode_prompt`` makes them: ``encode(prompts, length)`` of ``prompt`` at ``max_sequence_length`` or
    ``given(prompt_embeds, "prompt_embeds")`` (the embeddings checked; one of the two), then
    ``given(negative_prompt_embeds, "negative_prompt_embeds")`` or ``negative_prompt`` (default ``""`` for every
    prompt) encoded at ``max_sequence_length`` too (not at the length of given ``prompt_embeds``: diffusers encodes
    both at ``max_sequence_length``). ``shape``: an embedding's array shape ``[n, seq, dim]``. The two have the same
    rows and width; with ``same_length`` (the family runs both halves of guidance in one batch) also the same
    length, else a mismatch is refused naming both shapes and the fix."""
    if (prompt is None) == (prompt_embeds is None):
        raise InputError("pass prompt or prompt_embeds (one of them)")
    if prompt_embeds is None:
        positive = encode(prompt, max_sequence_length)
    else:
        positive = given(prompt_embeds, "prompt_embeds")
    if not guided:
        return positive, None
    if negative_prompt_embeds is not None:
        if negative_prompt is not None:
            raise InputError("pass negative_prompt or negative_prompt_embeds, not both")
        negative = given(negative_prompt_embeds, "negative_prompt_embeds")
    else:
        rows = shape(positive)[0]
        negative = encode(as_list("" if negative_prompt is None else negative_prompt, rows, "negative_prompt"),
                          max_sequence_length)
    ours, theirs = shape(positive), shape(negative)
    if theirs[0] != ours[0] or theirs[2:] != ours[2:]:
        raise InputError(f"negative embeddings of shape {theirs} for prompt embeddings of shape {ours}: pass one "
                         "negative per prompt, of the same width")
    if same_length and theirs[1] != ours[1]:
        raise InputError(_length_mismatch(ours, theirs, given_negative=negative_prompt_embeds is not None,
                                          given_positive=prompt_embeds is not None,
                                          max_sequence_length=max_sequence_length))
    return positive, negative


def _length_mismatch(ours, theirs, *, given_negative: bool, given_positive: bool, max_sequence_length: int) -> str:
    """The error for positive and negative embeddings of different lengths, where both halves of guidance run in
    one batch: both shapes, where each came from, and the fix."""
    positive = "prompt_embeds" if given_positive else f"the prompt encoded at max_sequence_length={max_sequence_length}"
    negative = ("negative_prompt_embeds" if given_negative
                else f"the negative prompt encoded at max_sequence_length={max_sequence_length}")
    if given_negative:
        fix = (f"pass negative_prompt_embeds (and negative_prompt_attention_mask, where the pipeline takes one) "
               f"{ours[1]} tokens long, as {'prompt_embeds are' if given_positive else 'the prompt is'}")
    else:
        fix = (f"pass max_sequence_length={ours[1]} (the length of prompt_embeds) so that the negative prompt is "
               f"encoded at it, or negative_prompt_embeds of that length")
    return (f"negative embeddings of shape {theirs} ({negative}) for prompt embeddings of shape {ours} ({positive}): "
            f"the two halves of classifier-free guidance run in one batch and need one sequence length; {fix}")


def zero_padding(embeds: Float[Array, "batch seq embed"],
                 mask: Int[Array | np.ndarray, "batch seq"] | Bool[Array | np.ndarray, "batch seq"]
                 ) -> Float[Array, "batch seq embed"]:
    """``embeds`` with every padding position (``mask`` 0) set to zero: diffusers' trim of each prompt's embeddings to
    its length and zero padding back to ``max_sequence_length`` (Wan's UMT5), for right-padded prompts."""
    return jnp.where(jnp.asarray(mask)[..., None] > 0, embeds, jnp.zeros((), embeds.dtype))


def _shown(prompt: str) -> str:
    return f"{prompt[:SHOWN_PROMPT]!r}{'...' if len(prompt) > SHOWN_PROMPT else ''}"
