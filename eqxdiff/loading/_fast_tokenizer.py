"""A tokenizer folder transformers saved from its ``tokenizers`` backend, read with ``tokenizers`` alone.

Importing transformers costs about 0.6 s of a 2 s start (``import eqxdiff`` + ``load_pipeline``), only to read the
tokenizer. A folder whose ``tokenizer_config.json`` says ``"backend": "tokenizers"`` holds in ``tokenizer.json`` the
very backend transformers runs (its ``save_pretrained`` writes it), so :class:`FileTokenizer` runs that file through
``tokenizers`` with the same per-call padding and truncation transformers sets: the same ids and masks. Any setting
transformers would act on beyond that file (remote code, a model ``config.json``, ``add_bos_token`` /
``add_eos_token``, split special tokens, a special token the file lacks, no ``tokenizer_class``) leaves the folder
to transformers (:func:`file_tokenizer` returns ``None``).

The interface is what eqxdiff uses: ``__call__`` (``padding="max_length"``, ``max_length``, ``truncation``,
``add_special_tokens``, ``return_attention_mask``, ``return_tensors="np"``), ``decode``, the special tokens and their
ids, ``model_max_length``, ``len()``, ``vocab_size``, ``save_pretrained`` and, for textual inversion, ``tokenize``,
``get_vocab``, ``added_tokens_encoder``, ``add_tokens`` and ``convert_tokens_to_ids``; ``transformers_class`` names the
class transformers reads the folder with (a saved pipeline's ``model_index.json`` entry)."""

import json
from pathlib import Path

import numpy as np

# transformers' model_max_length when the config gives none (VERY_LARGE_INTEGER)
UNLIMITED = int(1e30)
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# config keys with which transformers changes the backend read from tokenizer.json
_REBUILDS = ("auto_map", "add_bos_token", "add_eos_token")
# transformers' clean_up_tokenization: spaces before punctuation and contractions
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _content(token):
    """A special token's text: a string, or a serialized ``AddedToken`` (``{"content": ...}``)."""
    return token.get("content") if isinstance(token, dict) else token


class Encoded(dict):
    """What a call returns: ``input_ids`` and ``attention_mask`` as keys and attributes (transformers'
    ``BatchEncoding``, as far as eqxdiff reads it)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class FileTokenizer:
    """``tokenizer.json`` run by ``tokenizers``, with ``tokenizer_config.json``'s special tokens, lengths and
    sides; built by :func:`file_tokenizer`."""

    def __init__(self, backend, config: dict, files: dict[str, bytes]):
        self._backend = backend
        self._files = files
        self.init_kwargs = config
        padding, truncation = backend.padding or {}, backend.truncation or {}
        for name in SPECIAL:
            setattr(self, name, _content(config.get(name)))
        if self.pad_token is None:
            self.pad_token = padding.get("pad_token")  # as transformers takes it from tokenizer.json
        self.model_max_length = int(config.get("model_max_length") or UNLIMITED)
        self.padding_side = config.get("padding_side") or padding.get("direction") or "right"
        self.truncation_side = config.get("truncation_side") or truncation.get("direction") or "right"
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        # the transformers class that reads the folder (a pipeline's model_index.json entry when saved)
        self.transformers_class = config["tokenizer_class"]
        backend.no_padding()
        backend.no_truncation()

    def __getattr__(self, name):  # bos_token_id, eos_token_id, unk_token_id, pad_token_id, ...
        if name.endswith("_token_id") and name[:-3] in SPECIAL:
            token = getattr(self, name[:-3])
            return None if token is None else self._backend.token_to_id(token)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    @property
    def backend_tokenizer(self):
        return self._backend

    def __call__(self, text, *, padding=False, truncation=None, max_length=None, add_special_tokens=True,
                 return_attention_mask=None, return_tensors=None, verbose=True):
        """Token ids (and ``attention_mask``) of ``text`` (one string or a list), as transformers' tokenizer call with
        these keywords: ``padding`` ``False`` / ``True`` / ``"longest"`` / ``"max_length"``, ``truncation`` ``True``
        / ``"longest_first"`` (to ``max_length``, else ``model_max_length``)."""
        if padding not in (False, True, "longest", "max_length", "do_not_pad"):
            raise ValueError(f"padding={padding!r} is not supported here; use False, True, 'longest' or 'max_length'")
        if return_tensors not in (None, "np"):
            raise ValueError(f"return_tensors={return_tensors!r} is not supported here; use None or 'np'")
        pad = padding not in (False, "do_not_pad")
        if max_length is None and (padding == "max_length" or truncation not in (None, False, "do_not_truncate")):
            max_length = self.model_max_length if self.model_max_length < UNLIMITED else None
        if truncation not in (None, False, "do_not_truncate") and max_length is not None:
            self._backend.enable_truncation(max_length, stride=0, strategy="longest_first",
                                            direction=self.truncation_side)
        else:
            self._backend.no_truncation()
        if pad:
            if self.pad_token is None or self.pad_token_id is None:
                raise ValueError("this tokenizer has no pad_token, so it cannot pad; set pad_token in its "
                                 "tokenizer_config.json or call it without padding")
            self._backend.enable_padding(direction=self.padding_side, pad_id=self.pad_token_id,
                                         pad_token=self.pad_token,
                                         length=max_length if padding == "max_length" else None)
        else:
            self._backend.no_padding()
        batch = not isinstance(text, str)
        encodings = self._backend.encode_batch(list(text) if batch else [text], add_special_tokens=add_special_tokens)
        out = Encoded(input_ids=[e.ids for e in encodings])
        if return_attention_mask is not False:
            out["attention_mask"] = [e.attention_mask for e in encodings]
        for key, value in out.items():
            out[key] = np.asarray(value, np.int64) if return_tensors == "np" else value if batch else value[0]
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``: the file's decoder; a BPE's end-of-word suffix, where the decoder leaves it, read as a
        space (as transformers does); the clean-up the config asks for, which transformers skips for BPE."""
        ids = [int(ids)] if np.ndim(ids) == 0 else [int(i) for i in ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        suffix = getattr(self._backend.model, "end_of_word_suffix", None)
        if suffix:
            text = text.replace(suffix, " ").strip()
        if self._clean_up and type(self._backend.model).__name__ != "BPE":
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    # what textual inversion uses (transformers' names)

    def tokenize(self, text: str) -> list[str]:
        """The tokens of ``text``, no special tokens added."""
        return [self._backend.id_to_token(i) for i in self(text, add_special_tokens=False).input_ids]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in self._backend.get_added_tokens_decoder().items()}

    def add_tokens(self, tokens) -> int:
        """Add ``tokens`` (normal, not special, as transformers' ``add_tokens``); how many were new."""
        return self._backend.add_tokens(list(tokens))

    def convert_tokens_to_ids(self, tokens):
        return self._backend.token_to_id(tokens) if isinstance(tokens, str) else [self._backend.token_to_id(t)
                                                                                   for t in tokens]

    def save_pretrained(self, folder) -> tuple[str, ...]:
        """Write the files it was read from into ``folder`` (``tokenizer.json`` with the tokens added since):
        transformers reads them back as the same tokenizer."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        files = dict(self._files)
        saved = json.loads(files["tokenizer.json"])
        added = json.loads(self._backend.to_str())["added_tokens"]
        if added != saved.get("added_tokens"):  # the file's padding and truncation kept, not the last call's
            files["tokenizer.json"] = json.dumps({**saved, "added_tokens": added}, ensure_ascii=False).encode()
        for name, data in files.items():
            (folder / name).write_bytes(data)
        return tuple(str(folder / name) for name in files)

    def __repr__(self) -> str:
        return (f"FileTokenizer(vocab={len(self)}, model_max_length={self.model_max_length}, "
                f"special={ {n: getattr(self, n) for n in SPECIAL if getattr(self, n) is not None} })")


def file_tokenizer(folder) -> FileTokenizer | None:
    """``folder``'s tokenizer read with ``tokenizers`` alone, when transformers would run exactly its
    ``tokenizer.json`` (see the module); otherwise ``None`` (read it with transformers)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(config, dict) or config.get("backend") != "tokenizers" or config.get("split_special_tokens")
            or not isinstance(config.get("tokenizer_class"), str)
            or any(k in config for k in _REBUILDS) or not (folder / "tokenizer.json").is_file()
            or (folder / "config.json").exists()):
        return None
    try:
        special_map = json.loads((folder / "special_tokens_map.json").read_text())
    except OSError:
        special_map = {}
    for name in SPECIAL:  # transformers reads special_tokens_map.json's tokens over the config's
        if isinstance(special_map, dict) and special_map.get(name) is not None:
            config = {**config, name: special_map[name]}
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    named = [_content(config.get(n)) for n in SPECIAL] + [_content(t) for t in (extra if isinstance(extra, list)
                                                                                else extra.values())]
    if any(t is not None and backend.token_to_id(t) is None for t in named):
        return None  # transformers would add the missing special token as a new id
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    return FileTokenizer(backend, config, files)
