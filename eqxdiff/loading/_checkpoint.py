"""``load`` and ``save_pretrained``: Hugging Face diffusers/transformers folders <-> eqxdiff modules."""

import json
import os
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import nn
from ..core import family_names, resolve_class
from ._fill import CheckpointError, fill_module, state_dict
from ._safetensors import SafetensorsFile, write_safetensors

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
_WEIGHT_BASENAMES = ("diffusion_pytorch_model", "model")


def model_class(name: str):
    """The eqxdiff model class the family table (:data:`eqxdiff.core.FAMILY_TABLE`) gives checkpoint class
    ``name``."""
    cls = resolve_class(name)
    if cls is None or not hasattr(cls, "config_class"):
        raise CheckpointError(f"unknown model class {name!r}; eqxdiff can load: {family_names('model')}")
    return cls


def check_dtype(dtype):
    """Return ``dtype`` as a ``jnp.dtype`` if models can run in it, else raise naming the choices."""
    if dtype is None:
        return None
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise CheckpointError(f"unknown dtype {dtype!r}; use one of {SUPPORTED_DTYPES}") from e
    if dt.name not in SUPPORTED_DTYPES:
        raise CheckpointError(f"models cannot run in dtype {dt.name}; use one of {SUPPORTED_DTYPES}")
    return dt


# Pipelines shipped inside the package (package data), found by their bare name when no local folder has it.
PACKAGED_MODELS = {"digits": Path(__file__).resolve().parent.parent / "assets" / "digits"}


def _looks_local(p: str) -> bool:
    return p.startswith((".", "/", "~")) or os.sep in p.strip("/").replace("/", "", 1) or p.count("/") != 1


def resolve_folder(path_or_hub_id: str | os.PathLike, subfolder: str | None = None, *,
                   revision: str | None = None) -> Path:
    """A local folder, a Hugging Face Hub id fetched (or found in the cache) with ``huggingface_hub``, or the bare
    name of a pipeline shipped inside eqxdiff (``"digits"``; a local folder of that name wins)."""
    p = os.fspath(path_or_hub_id)
    local = Path(p).expanduser()
    if local.is_dir():
        folder = local
    elif local.exists():
        raise CheckpointError(f"{p!r} is a file; pass the model's folder (the one holding config.json)")
    elif p in PACKAGED_MODELS:
        folder = PACKAGED_MODELS[p]
    elif _looks_local(p):
        raise CheckpointError(f"model folder {p!r} does not exist; pass a folder saved with save_pretrained "
                              "or a Hugging Face Hub id such as 'owner/name'")
    else:
        from huggingface_hub import snapshot_download
        patterns = None if subfolder is None else [f"{subfolder}/*", "model_index.json"]
        try:
            folder = Path(snapshot_download(p, revision=revision, allow_patterns=patterns))
        except Exception as e:  # network, auth and offline errors all end here
            raise CheckpointError(
                f"could not fetch {p!r} from the Hugging Face Hub ({type(e).__name__}: {e}). Offline, download "
                "it on a connected machine (`hf download ID --local-dir DIR`) and pass DIR instead.") from e
    if subfolder:
        folder = folder / subfolder
        if not folder.is_dir():
            raise CheckpointError(f"subfolder {subfolder!r} not found in {p!r}")
    return folder


def read_config(folder: Path, name: str = "config.json") -> dict:
    path = Path(folder) / name
    if not path.is_file():
        raise CheckpointError(f"{name} not found in {os.fspath(folder)!r}; is this a diffusers/transformers "
                              "model folder?")
    with open(path) as f:
        return json.load(f)


class CheckpointFiles:
    """One or several safetensors shards seen as one name -> tensor mapping.

    ``key_map``: ``(pattern, replacement)`` regexes applied in turn (``re.sub``) to every stored name, so a model
    can read the names another library version wrote (a model class declares them as ``CHECKPOINT_KEY_MAP``).
    """

    def __init__(self, paths, key_map=()):
        self.files = [SafetensorsFile(p) for p in paths]
        self._where = {}
        for f in self.files:
            for stored in f.names():
                name = stored
                for pattern, replacement in key_map:
                    name = re.sub(pattern, replacement, name)
                if key_map and name in self._where:
                    raise CheckpointError(f"checkpoint tensors {self._where[name][1]!r} and {stored!r} both read "
                                          f"as {name!r}; keep only one of them")
                self._where[name] = (f, stored)

    def names(self):
        return list(self._where)

    def shape(self, name):
        f, stored = self._where[name]
        return f.shape(stored)

    def get(self, name):
        f, stored = self._where[name]
        return f.get(stored)


def weight_files(folder: Path, variant: str | None = None) -> list[Path]:
    """The safetensors file(s) holding a model's weights, single or sharded by an index."""
    suffix = f".{variant}" if variant else ""
    for base in _WEIGHT_BASENAMES:
        single = folder / f"{base}{suffix}.safetensors"
        if single.is_file():
            return [single]
        for index in (folder / f"{base}{suffix}.safetensors.index.json",
                      folder / f"{base}.safetensors.index{suffix}.json"):
            if index.is_file():
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
                missing = [s for s in shards if not (folder / s).is_file()]
                if missing:
                    raise CheckpointError(f"{index.name} lists shard(s) missing from {os.fspath(folder)!r}: {missing}")
                return [folder / s for s in shards]
    bins = sorted(x.name for x in folder.glob("*.bin"))
    if bins:
        raise CheckpointError(
            f"{os.fspath(folder)!r} holds only PyTorch pickle weights ({', '.join(bins)}); eqxdiff reads safetensors. "
            "Convert once with diffusers/transformers: `Model.from_pretrained(folder).save_pretrained(folder, "
            "safe_serialization=True)`.")
    want = f"{_WEIGHT_BASENAMES[0]}{suffix}.safetensors or {_WEIGHT_BASENAMES[1]}{suffix}.safetensors"
    others = sorted(x.name for x in folder.glob("*.safetensors"))
    hint = f" (found {others}; is the variant right?)" if others else ""
    raise CheckpointError(f"no weights file in {os.fspath(folder)!r}: expected {want}{hint}")


def class_name_of(config: dict, folder) -> str:
    name = config.get("_class_name") or (config.get("architectures") or [None])[0]
    if not name:
        raise CheckpointError(f"config.json in {os.fspath(folder)!r} names no model class "
                              "(no `_class_name` or `architectures` key)")
    return name


def load(path_or_hub_id, subfolder: str | None = None, *, dtype=None, revision: str | None = None,
         variant: str | None = None, sharding=None, config_overrides: dict | None = None,
         scan_layers: bool = False):
    """Load the model a diffusers/transformers folder (or Hub id) describes, straight from its safetensors.

    The module is built abstractly (``eqx.filter_eval_shape``) and each leaf read from the file in ``dtype``
    (default: float32) and, if ``sharding(name, shape)`` returns one, onto that sharding. ``scan_layers=True``
    builds the repeated layers stacked (``eqxdiff.nn.scan_layers``: run with ``lax.scan``, same numbers) and fills
    each stacked leaf straight from the per-layer tensors.
    """
    dt = check_dtype(dtype) or jnp.dtype(jnp.float32)
    folder = resolve_folder(path_or_hub_id, subfolder, revision=revision)
    raw = read_config(folder)
    if config_overrides:
        raw = {**raw, **config_overrides}
    cls = model_class(class_name_of(raw, folder))
    config = cls.config_class.from_dict(raw)
    files = weight_files(folder, variant)
    def build():
        model = cls(config, dtype=dt, key=jax.random.key(0))
        if not scan_layers:
            return model
        try:
            return nn.scan_layers(model)
        except ValueError as e:
            raise CheckpointError(f"scan_layers=True: {e}") from None

    abstract = eqx.filter_eval_shape(build)
    checkpoint = CheckpointFiles(files, key_map=getattr(cls, "CHECKPOINT_KEY_MAP", ()))
    return fill_module(abstract, checkpoint, dtype=dt, sharding=sharding,
                       ignore=getattr(cls, "CHECKPOINT_IGNORE", ()), where=f"checkpoint in {os.fspath(folder)!r}")


def save_pretrained(module, folder, *, dtype=None) -> Path:
    """Write ``module`` as a diffusers/transformers folder (config.json + safetensors) that they load again."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "config.json", "w") as f:
        json.dump(module.checkpoint_config(), f, indent=2, sort_keys=True)
    tensors = state_dict(module)
    if dtype is not None:
        dt = check_dtype(dtype)
        tensors = {k: v.astype(dt) if v.dtype.kind == "f" or v.dtype.name == "bfloat16" else v
                   for k, v in tensors.items()}
    base = "model" if getattr(module, "CHECKPOINT_FORMAT", "diffusers") == "transformers" else _WEIGHT_BASENAMES[0]
    write_safetensors(tensors, folder / f"{base}.safetensors", metadata={"format": "pt"})
    return folder


__all__ = ["load", "save_pretrained", "resolve_folder", "read_config", "weight_files", "model_class",
           "check_dtype", "CheckpointError", "CheckpointFiles"]
