"""Textual inversion, as diffusers' ``TextualInversionLoaderMixin``:
:meth:`TextualInversionMixin.load_textual_inversion` adds learned token embeddings to a tokenizer and its text
encoder, :meth:`~TextualInversionMixin.maybe_convert_prompt` spells a multi-vector token out in a prompt (``"<cat>"``
-> ``"<cat> <cat>_1 <cat>_2"``) before it is tokenized, and :meth:`~TextualInversionMixin.unload_textual_inversion`
takes the tokens out again.

>>> pipe.load_textual_inversion("sd-concepts-library/cat-toy")                      # learned_embeds.safetensors
>>> pipe.load_textual_inversion("./charturner.safetensors", token="<charturner>")   # an A1111 file (emb_params)
>>> images = pipe("a <cat-toy> on a beach")

An SDXL file holds one embedding per text encoder (``clip_l``, ``clip_g``): load each into its encoder, as diffusers
does (``tensors`` from :func:`safetensors.numpy.load_file`)::

    pipe.load_textual_inversion(tensors["clip_l"], token="<x>")
    pipe.load_textual_inversion(tensors["clip_g"], token="<x>", tokenizer=pipe.tokenizer_2,
                                text_encoder=pipe.text_encoder_2)

The pipeline's tokenizer is a copy with the new tokens (the one it was loaded with, which :meth:`from_pipe` may share,
is left alone); the text encoder's token table grows to the tokenizer's length (diffusers resizes it to that length
even where it is shorter; eqxdiff never shrinks it, which changes no output). Files are read as safetensors only;
a ``.pt`` / ``.bin`` embedding is refused (a pickle). A text encoder declares its token table
(:attr:`~eqxdiff.models.PretrainedModel.INPUT_EMBEDDINGS`)."""

import copy
import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import numpy as np

from .. import nn
from ..core import has_field, map_modules, replace_static
from ..loading import read_safetensors_file, safetensors_path
from ._arguments import host_array

__all__ = ["TextualInversionMixin", "embedding_path", "expand_multi_vector_tokens"]

DEFAULT_WEIGHT_NAME = "learned_embeds.safetensors"  # diffusers' name for the trained embedding


def expand_multi_vector_tokens(tokenizer, prompt: str) -> str:
    """``prompt`` with each added token ``t`` that has added followers ``t_1``, ``t_2``, ... spelled out as
    ``"t t_1 t_2"`` (diffusers' ``maybe_convert_prompt``, replacing every occurrence of the text ``t``)."""
    added = tokenizer.added_tokens_encoder
    for token in set(tokenizer.tokenize(prompt)):
        if token not in added:
            continue
        followers, i = [], 1
        while f"{token}_{i}" in added:
            followers.append(f"{token}_{i}")
            i += 1
        prompt = prompt.replace(token, " ".join([token, *followers]))
    return prompt


def _table(model) -> "nn.Embedding":
    path = getattr(type(model), "INPUT_EMBEDDINGS", None)
    if path is None:
        raise TypeError(f"{type(model).__name__} has no token table to add textual-inversion tokens to")
    return functools.reduce(getattr, path.split("."), model)


def with_token_rows(model, weight):
    """``model`` with its token table ``weight`` (placed as the old one) and ``vocab_size`` its rows."""
    old = _table(model).weight
    if not isinstance(old, jax.ShapeDtypeStruct):
        weight = nn.place_like(np.asarray(weight, np.dtype(old.dtype)), old)
    model = eqx.tree_at(lambda m: _table(m).weight, model, weight)
    config = model.config
    new = dataclasses.replace(config, vocab_size=int(weight.shape[0]))
    return map_modules(lambda m: replace_static(m, config=new) if has_field(m, "config") and m.config is config
                       else m, model)


@dataclasses.dataclass
class _Loaded:
    """What one tokenizer / text encoder pair held before its first textual inversion, and the tokens since."""

    tokenizer: Any
    table: Any  # the text encoder's token table before
    rows: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # token -> its embedding, in load order


class TextualInversionMixin:
    """diffusers' textual-inversion methods (see the module docstring)."""

    # A file key -> the (tokenizer, text encoder) pair it is for, in files holding one embedding per text encoder
    # (SDXL's clip_l / clip_g), loaded into each pair by one call when no pair is named (diffusers needs a call each)
    TEXTUAL_INVERSION_FILE_KEYS: ClassVar[Mapping[str, tuple[str, str]]] = {}

    def maybe_convert_prompt(self, prompt: str | Sequence[str], tokenizer) -> str | list[str]:
        """``prompt`` (one or a list) with each multi-vector token ``tokenizer`` holds spelled out
        (:func:`expand_multi_vector_tokens`); the pipelines call it before tokenizing, as diffusers'."""
        if isinstance(prompt, str):
            return expand_multi_vector_tokens(tokenizer, prompt)
        return [expand_multi_vector_tokens(tokenizer, p) for p in prompt]

    def _pair(self, tokenizer, text_encoder) -> tuple[str, str]:
        """The component names of ``tokenizer`` / ``text_encoder`` (objects of this pipeline; one names the other:
        ``tokenizer_2`` goes with ``text_encoder_2``), default ``tokenizer`` / ``text_encoder``."""
        def name_of(obj, kind: str) -> str | None:
            if obj is None:
                return None
            for c in self.COMPONENTS:
                if c.name.startswith(kind) and getattr(self, c.name, None) is obj:
                    return c.name
            raise ValueError(f"load_textual_inversion: the {kind} given is none of this pipeline's; pass "
                             f"pipe.{kind} or pipe.{kind}_2 (as diffusers: tokenizer=pipe.tokenizer_2, "
                             "text_encoder=pipe.text_encoder_2)")

        tok, enc = name_of(tokenizer, "tokenizer"), name_of(text_encoder, "text_encoder")
        tok = tok or (enc.replace("text_encoder", "tokenizer") if enc else "tokenizer")
        enc = enc or tok.replace("tokenizer", "text_encoder")
        if tok.replace("tokenizer", "") != enc.replace("text_encoder", ""):
            raise ValueError(f"load_textual_inversion: {tok} does not go with {enc}; pass a tokenizer and its own "
                             "text encoder")
        if getattr(self, tok, None) is None or getattr(self, enc, None) is None:
            raise ValueError(f"load_textual_inversion: this pipeline has no {tok} / {enc}")
        return tok, enc

    def load_textual_inversion(self, pretrained_model_name_or_path, token: str | Sequence[str] | None = None,
                               tokenizer=None, text_encoder=None, *, weight_name: str | None = None,
                               revision: str | None = None, subfolder: str | None = None) -> None:
        """Add learned embeddings to ``tokenizer`` / ``text_encoder`` (default the pipeline's first pair), as
        diffusers' ``load_textual_inversion``: a ``.safetensors`` file, a folder or Hub id holding ``weight_name``
        (default ``learned_embeds.safetensors``), a state dict (``{token: embedding}``, A1111's
        ``string_to_param``) or an array (with ``token=``); or a list of these with a list of tokens. ``token``
        names the new token (default: the file's one key). An embedding of ``n > 1`` vectors becomes the tokens
        ``token``, ``token_1``, ..., ``token_{n-1}``, which prompts spell out (:meth:`maybe_convert_prompt`)."""
        if tokenizer is None and text_encoder is None and not isinstance(pretrained_model_name_or_path, list):
            state = _read(pretrained_model_name_or_path, weight_name=weight_name, revision=revision,
                          subfolder=subfolder)
            if self._load_per_encoder(state, token):
                return
            pretrained_model_name_or_path = state
        tok_name, enc_name = self._pair(tokenizer, text_encoder)
        sources = list(pretrained_model_name_or_path) if isinstance(pretrained_model_name_or_path, list) \
            else [pretrained_model_name_or_path]
        tokens = list(token) if isinstance(token, (list, tuple)) else [token] * len(sources)
        loaded = [_read(s, weight_name=weight_name, revision=revision, subfolder=subfolder) for s in sources]
        if len(loaded) == 1 < len(tokens) and hasattr(loaded[0], "shape"):  # one array, a row per token
            loaded = list(_array(loaded[0]))
        if len(tokens) != len(loaded):
            raise ValueError(f"load_textual_inversion: {len(loaded)} embeddings but {len(tokens)} tokens; pass one "
                             "token per embedding")
        tok = getattr(self, tok_name)
        encoder = getattr(self, enc_name)
        width = _table(encoder).weight.shape[-1]
        new: dict[str, np.ndarray] = {}
        for given, state in zip(tokens, loaded):
            name, embedding = _token_and_embedding(given, state)
            if name in tok.get_vocab() or name in new:
                raise ValueError(f"load_textual_inversion: token {name!r} is in {tok_name}'s vocabulary already; "
                                 "pass another token= or unload_textual_inversion it first")
            if f"{name}_1" in tok.get_vocab():
                raise ValueError(f"load_textual_inversion: multi-vector token {name!r} ({name}_1, ...) is in "
                                 f"{tok_name}'s vocabulary already; pass another token= or unload it first")
            if embedding.shape[-1] != width:
                raise ValueError(f"load_textual_inversion: the embedding of {name!r} is {embedding.shape[-1]} wide, "
                                 f"{enc_name}'s tokens are {width}: it was trained for another text encoder")
            rows = embedding.reshape(-1, width)
            for i, row in enumerate(rows):
                new[name if i == 0 else f"{name}_{i}"] = row
        loads = self.__dict__.setdefault("_textual_inversion", {})
        state = loads.setdefault(tok_name, _Loaded(tok, _table(encoder).weight))
        self._set_tokens(tok_name, enc_name, state, {**state.rows, **new})

    def _load_per_encoder(self, state, token) -> bool:
        """Load a file of :attr:`TEXTUAL_INVERSION_FILE_KEYS` into the pairs this pipeline has; whether it was one."""
        keys = self.TEXTUAL_INVERSION_FILE_KEYS
        if not isinstance(state, Mapping) or len(state) < 2 or not set(state) <= set(keys):
            return False
        if not isinstance(token, str):
            raise ValueError(f"load_textual_inversion: the file holds one embedding per text encoder {sorted(state)} "
                             "and no token; pass token=")
        pairs = [(key, *keys[key]) for key in state if getattr(self, keys[key][1], None) is not None]
        if not pairs:
            raise ValueError(f"load_textual_inversion: the file's embeddings {sorted(state)} are for text encoders "
                             "this pipeline lacks")
        for key, tok, enc in pairs:
            self.load_textual_inversion(state[key], token=token, tokenizer=getattr(self, tok),
                                        text_encoder=getattr(self, enc))
        return True

    def unload_textual_inversion(self, tokens: str | Sequence[str] | None = None, tokenizer=None,
                                 text_encoder=None) -> None:
        """Take tokens added by :meth:`load_textual_inversion` out of ``tokenizer`` / ``text_encoder`` (default the
        first pair): ``tokens`` (a multi-vector token's followers go with it), or all of them."""
        tok_name, enc_name = self._pair(tokenizer, text_encoder)
        state = self.__dict__.get("_textual_inversion", {}).get(tok_name)
        if state is None:
            raise ValueError(f"unload_textual_inversion: no textual inversion is loaded into {tok_name}")
        if tokens is None:
            kept = {}
        else:
            names = [tokens] if isinstance(tokens, str) else list(tokens)
            unknown = [t for t in names if t not in state.rows]
            if unknown:
                raise ValueError(f"unload_textual_inversion: {unknown} not loaded into {tok_name}; it holds "
                                 f"{sorted(state.rows)}")
            gone = {t for t in state.rows if t in names or _follows(t, names)}
            kept = {t: r for t, r in state.rows.items() if t not in gone}
        self._set_tokens(tok_name, enc_name, state, kept)

    def _set_tokens(self, tok_name: str, enc_name: str, state: _Loaded, rows: Mapping[str, np.ndarray]) -> None:
        """The pair as it was before any textual inversion, plus ``rows`` (token -> embedding) in order; the LoRA
        state's copies of the text encoder too (so that unloading a LoRA keeps the tokens)."""
        tok = copy.deepcopy(state.tokenizer)
        if rows:
            tok.add_tokens(list(rows))
        ids = tok.convert_tokens_to_ids(list(rows))
        before = np.asarray(state.table)
        table = np.concatenate([before, np.zeros((max(len(tok) - len(before), 0), before.shape[1]), before.dtype)])
        for i, row in zip(ids, rows.values()):
            table[i] = row
        setattr(self, tok_name, tok if rows else state.tokenizer)
        setattr(self, enc_name, with_token_rows(getattr(self, enc_name), table))
        self.rewrite_lora_copies(enc_name, lambda encoder: with_token_rows(encoder, table))
        state.rows = dict(rows)


def _follows(token: str, names) -> bool:
    """Whether ``token`` is a multi-vector follower (``<cat>_2``) of one of ``names``."""
    head, _, index = token.rpartition("_")
    return index.isdigit() and head in names


def _read(source, *, weight_name, revision, subfolder):
    """A state dict (or an array) from what ``load_textual_inversion`` was given."""
    if isinstance(source, Mapping) or hasattr(source, "shape"):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_textual_inversion: expected a file, folder, Hub id, state dict or array, got "
                        f"{type(source).__name__}")
    name = weight_name if subfolder is None else f"{subfolder}/{weight_name or DEFAULT_WEIGHT_NAME}"
    return read_safetensors_file(embedding_path(source, weight_name=name, revision=revision))


def embedding_path(source, *, weight_name: str | None = None, revision: str | None = None):
    """The ``.safetensors`` embedding file ``source`` names: a file, a folder or Hub id holding ``weight_name``
    (default ``learned_embeds.safetensors``); a pickle (``.pt`` / ``.bin``) or a missing file is refused."""
    return safetensors_path(source, weight_name=weight_name, revision=revision, default_name=DEFAULT_WEIGHT_NAME,
                            what="textual inversion")


def _token_and_embedding(token: str | None, state) -> tuple[str, np.ndarray]:
    """diffusers' rules: an array needs ``token``; a one-key dict is ``{token: embedding}``; A1111's
    ``string_to_param`` holds ``"*"``; ``token`` replaces the file's name."""
    if hasattr(state, "shape"):
        if token is None:
            raise ValueError("load_textual_inversion: an embedding given as an array needs its token: pass token=")
        return token, _array(state)
    if len(state) == 1:
        name, embedding = next(iter(state.items()))
        return token or name, _array(embedding)
    if "string_to_param" in state:
        return token or state["name"], _array(state["string_to_param"]["*"])
    raise ValueError(f"load_textual_inversion: the file holds {sorted(state)}, not one embedding. A file of one "
                     "embedding per text encoder loads key by key: load_textual_inversion(tensors[key], token=..., "
                     "tokenizer=pipe.tokenizer_2, text_encoder=pipe.text_encoder_2) for the second encoder's key, "
                     "without tokenizer= / text_encoder= for the first's")


def _array(x) -> np.ndarray:
    return host_array(x, np.float32)
