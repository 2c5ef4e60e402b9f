"""Which transformers class reads a tokenizer folder, found without importing ``AutoTokenizer``: that module
imports transformers' model-configuration machinery, and with it PyTorch when installed (seconds at start-up), which
reading a tokenizer never needs."""

import json
from pathlib import Path

from ..core import import_transformers

# Classes AutoTokenizer does not simply take by name: a Llama tokenizer may be read as another (ByteLevel) backend.
_AUTO_ONLY = ("LlamaTokenizer",)


def tokenizer_class(folder) -> type:
    """The class ``transformers.AutoTokenizer.from_pretrained(folder)`` reads ``folder`` with, when the folder names
    it in ``tokenizer_config.json`` (``tokenizer_class``; its fast class first, as AutoTokenizer prefers) and has
    neither a model ``config.json`` nor an ``auto_map`` (remote code) for AutoTokenizer to weigh: a diffusers
    pipeline's ``tokenizer`` folder. Otherwise ``transformers.AutoTokenizer`` itself."""
    transformers = import_transformers()  # without its 'PyTorch was not found' notice
    folder = Path(folder)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if isinstance(name, str) and "auto_map" not in config and not (folder / "config.json").exists():
        base = name.removesuffix("Fast")
        for candidate in (() if base in _AUTO_ONLY else (base + "Fast", base)):
            try:
                cls = getattr(transformers, candidate)
            except (AttributeError, ImportError):  # not a transformers class, or its backend is not installed
                continue
            if isinstance(cls, type) and cls.__name__ != "PythonBackend":
                return cls
    return transformers.AutoTokenizer
