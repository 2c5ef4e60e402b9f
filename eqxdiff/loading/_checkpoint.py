"""``load`` and ``save_pretrained``: Hugging Face diffusers/transformers folders <-> eqxdiff modules."""

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from .. import nn
from ..core import ConfigError, ModelConfig, family_names, resolve_class
from ._convert import (
    Concat,
    Drop,
    Rename,
    Rule,
    Substitute,
    convert,
    convert_tensors,
    inverse,
)
from ._errors import PICKLE_SUFFIXES, CheckpointError, check_not_scaled_float8, pickle_error, pickle_folder_error
from ._fill import fill_module, state_dict
from ._lone import part_rules
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


_class_named = model_class  # ``load``'s argument of that name hides the function there


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


def is_hub_id(path: str | os.PathLike) -> bool:
    """``path`` names no local file or folder and reads as a Hugging Face Hub id (``owner/name``): what
    :func:`resolve_folder` fetches from the Hub."""
    p = os.fspath(path)
    return not Path(p).expanduser().exists() and not _looks_local(p)


def resolve_folder(path_or_hub_id: str | os.PathLike, subfolder: str | None = None, *,
                   revision: str | None = None) -> Path:
    """A local folder, a Hugging Face Hub id fetched (or found in the cache) with ``huggingface_hub``, or the bare
    name of a pipeline shipped inside eqxdiff (``"digits"``; a local folder of that name wins)."""
    p = os.fspath(path_or_hub_id)
    local = Path(p).expanduser()
    if local.is_dir():
        folder = local
    elif local.exists():
        if local.suffix.lower() in PICKLE_SUFFIXES:
            raise pickle_error(local)
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


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object from ``path``; a file that does not parse raises :class:`CheckpointError` naming it and the
    line."""
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{os.fspath(path)!r} is not valid JSON: {e.msg} at line {e.lineno}, column "
                              f"{e.colno}. Fix that line, or download the file again if it came cut short") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{os.fspath(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); download "
                              "it again") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{os.fspath(path)!r} holds a JSON {type(out).__name__}, not an object of settings")
    return out


def read_config(folder: Path, name: str = "config.json") -> dict:
    """``folder/name`` (``config.json``, ``model_index.json``, ``scheduler_config.json``) as a dict."""
    path = Path(folder) / name
    if not path.is_file():
        raise CheckpointError(f"{name} not found in {os.fspath(folder)!r}; {_where_it_is(Path(folder), name)}")
    return read_json(path)


def _where_it_is(folder: Path, name: str) -> str:
    """The hint for a missing ``name``: the subfolder(s) holding one (a training run's ``pipeline/``, a pipeline's
    ``unet/``), else the question whether this is a model folder at all."""
    holders = sorted(p.parent for p in folder.glob(f"*/{name}")) if folder.is_dir() else []
    if len(holders) == 1:
        return f"did you mean {os.fspath(holders[0])!r}?"
    if holders:
        shown = ", ".join(p.name for p in holders[:6]) + (", ..." if len(holders) > 6 else "")
        return f"its subfolders {shown} each hold one: pass the one you mean (or subfolder=)"
    return "is this a diffusers/transformers model folder?"


def key_map_rules(key_map) -> tuple[Rule, ...]:
    """A model's ``CHECKPOINT_KEY_MAP`` (``(pattern, replacement)`` regexes, ``re.sub`` in turn on every name: the
    names another library version wrote) as conversion rules."""
    return tuple(Substitute(pattern, replacement) for pattern, replacement in key_map)


def alias_rules(aliases: Mapping[str, Sequence[str]], names) -> tuple[Rule, ...]:
    """A model's ``CHECKPOINT_ALIASES`` (``{name: (alias, ...)}``: a tied tensor that files store under ``name``, an
    alias, or both) as rules for a checkpoint holding ``names``: ``name`` is read from the first alias held when
    the checkpoint lacks it; the other aliases held are dropped."""
    names, rules = set(names), []
    for name, others in aliases.items():
        held = [a for a in others if a in names]
        if held and name not in names:
            rules.append(Rename(held.pop(0), name))
        if held:
            rules.append(Drop(tuple(held)))
    return tuple(rules)


def fusion_rules(model) -> tuple[Rule, ...]:
    """A model's ``fused_tensors()`` (tensors it holds fused that checkpoints store apart) as the ``Concat`` rules
    that build them at load time; their :func:`inverse` splits them back on saving."""
    fused = getattr(model, "fused_tensors", None)
    return tuple(Concat(sources, target, 0, sizes) for sources, target, sizes in (fused() if fused else ()))


class CheckpointFiles:
    """One or several safetensors shards seen as one name -> tensor mapping (``names/shape/dtype/get``).

    ``key_map``: ``(pattern, replacement)`` regexes applied in turn (``re.sub``) to every stored name, so a model
    can read the names another library version wrote (a model class declares them as ``CHECKPOINT_KEY_MAP``).
    """

    def __init__(self, paths, key_map=()):
        self.files = [SafetensorsFile(p) for p in paths]
        self._file = {name: f for f in self.files for name in f.names()}
        self._view = convert(_Stored(self._file), key_map_rules(key_map), where="checkpoint")

    def names(self):
        return self._view.names()

    def shape(self, name):
        return self._view.shape(name)

    def dtype(self, name):
        return self._view.dtype(name)

    def get(self, name):
        return self._view.get(name)


class _Stored:
    def __init__(self, file_of: Mapping[str, SafetensorsFile]):
        self._file = file_of

    def names(self):
        return list(self._file)

    def shape(self, name):
        return self._file[name].shape(name)

    def dtype(self, name):
        return self._file[name].dtype(name)

    def get(self, name):
        return self._file[name].get(name)


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
                weight_map = read_json(index).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise CheckpointError(f"{os.fspath(index)!r} has no weight_map; download it again")
                shards = sorted(set(weight_map.values()))
                missing = [s for s in shards if not (folder / s).is_file()]
                if missing:
                    raise CheckpointError(f"{index.name} lists shard(s) missing from {os.fspath(folder)!r}: {missing}")
                return [folder / s for s in shards]
    pickles = sorted(x.name for x in folder.iterdir() if x.is_file() and x.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise pickle_folder_error(folder, pickles)
    want = f"{_WEIGHT_BASENAMES[0]}{suffix}.safetensors or {_WEIGHT_BASENAMES[1]}{suffix}.safetensors"
    others = sorted(x.name for x in folder.glob("*.safetensors"))
    hint = f" (found {others}; is the variant right?)" if others else ""
    raise CheckpointError(f"no weights file in {os.fspath(folder)!r}: expected {want}{hint}")


def class_name_of(config: Mapping, where: str) -> str:
    """The model class a config names (``_class_name``, or ``architectures[0]``); ``where`` describes the config."""
    name = config.get("_class_name") or (config.get("architectures") or [None])[0]
    if not name:
        raise CheckpointError(f"{where} names no model class (no `_class_name` or `architectures` key); pass "
                              "model_class= to say which model it configures")
    return name


def load(path_or_hub_id, subfolder: str | None = None, *, dtype=None, revision: str | None = None,
         variant: str | None = None, sharding=None, config_overrides: dict | None = None,
         scan_layers: bool = False, model_class: str | type | None = None,
         config: ModelConfig | Mapping | str | os.PathLike | None = None, conversion: Sequence[Rule] = ()):
    """Load the model a diffusers/transformers folder (or Hub id) describes, straight from its safetensors.

    The module is built abstractly (``eqx.filter_eval_shape``) and each leaf read from the file in ``dtype``
    (default: float32; float8 files are cast to it) and, if ``sharding(name, shape)`` returns one, onto that
    sharding. ``scan_layers=True`` builds the repeated layers stacked (``eqxdiff.nn.scan_layers``: run with
    ``lax.scan``, same numbers) and fills each stacked leaf straight from the per-layer tensors.
    ``config_overrides`` sets config keys over the checkpoint's (each a field of the model's config class; an eqxdiff
    setting such as Flux's ``fused_projections``, or a value to try).

    A lone ``.safetensors`` file (no config.json beside it) is read when the call says what it holds:
    ``config`` (a config object, a dict of config.json's keys, a config.json path, or a folder / Hub id holding
    config.json; ``subfolder`` and ``revision`` then apply to it) and, unless that config names it,
    ``model_class`` (a checkpoint class name such as ``"CLIPTextModel"``, or the eqxdiff class).
    ``conversion``: rules (``Rename``, ``Split``, ... from :mod:`eqxdiff.loading`; known formats in
    :mod:`eqxdiff.loading.formats`) that turn the file's names and layouts into the model's, e.g.
    ``eqxdiff.load("open_clip.safetensors", model_class="CLIPTextModelWithProjection", config=cfg,
    conversion=formats.OPENCLIP_TEXT)``. ``model_class`` and ``config`` also override a folder's. Without
    ``conversion``, a lone file (or a folder given ``config``) in the original names a family's single-file layouts
    declare is read through that part's rules (``eqxdiff.load("wan_2.1_vae.safetensors", config=VAE_FOLDER)``).
    """
    dt = check_dtype(dtype) or jnp.dtype(jnp.float32)
    lone = Path(os.fspath(path_or_hub_id)).expanduser()
    if lone.is_file():
        if lone.suffix.lower() in PICKLE_SUFFIXES:
            raise pickle_error(lone)
        if config is None:
            raise _lone_file_error(path_or_hub_id, model_class)
        if lone.suffix != ".safetensors":
            raise CheckpointError(f"{os.fspath(lone)!r} is not a .safetensors file; eqxdiff reads safetensors")
        files, where = [lone], f"file {os.fspath(lone)!r}"
        source, described = _config_source(config, subfolder, revision), "the config passed to load"
    else:
        folder = resolve_folder(path_or_hub_id, subfolder, revision=revision)
        if config is None:
            source, described = read_config(folder), f"config.json in {os.fspath(folder)!r}"
        else:
            source, described = _config_source(config, None, revision), "the config passed to load"
        files, where = weight_files(folder, variant), f"checkpoint in {os.fspath(folder)!r}"
    named = config is not None  # the call says what the checkpoint holds: it may be in a family's original names
    cls, config = _class_and_config(source, described, model_class, config_overrides or {})

    def build():
        model = cls(config, dtype=dt, key=jax.random.key(0))
        if not scan_layers:
            return model
        try:
            return nn.scan_layers(model)
        except ValueError as e:
            raise CheckpointError(f"scan_layers=True: {e}") from None

    abstract = nn.build_abstract(build)
    check_not_scaled_float8(CheckpointFiles(files).names(), where)
    found = False  # the rules of a family's single-file part, found by the tensors (not passed)
    if not conversion and (named or lone.is_file()):
        conversion = part_rules(CheckpointFiles(files), abstract, config, cls, where=where)
        found = bool(conversion)
    rules = (*conversion, *key_map_rules(getattr(cls, "CHECKPOINT_KEY_MAP", ())))
    checkpoint = convert(CheckpointFiles(files), rules, where=where)
    checkpoint = convert(checkpoint, alias_rules(getattr(cls, "CHECKPOINT_ALIASES", {}), checkpoint.names()),
                         where=where)
    hint = ("The file is in a family's original names, but its tensors are not those of the config passed: pass "
            "config= the config of the model it holds." if found
            else "Check that the config and the conversion rules fit this file." if conversion or lone.is_file()
            else "Check that config.json belongs to these weights.")
    checkpoint = convert(checkpoint, fusion_rules(abstract), where=where)
    keep = cls.keep_in_float32(dt) if hasattr(cls, "keep_in_float32") else ()
    return fill_module(abstract, checkpoint, dtype=dt, sharding=sharding,
                       ignore=getattr(cls, "CHECKPOINT_IGNORE", ()), where=where, hint=hint, keep_float32=keep)


def _lone_file_error(path, model_class) -> CheckpointError:
    """What a lone file loaded without ``config=`` lacks: the config (with ``model_class`` given: the class alone does
    not give the widths), or both."""
    if model_class is not None:
        name = model_class if isinstance(model_class, str) else getattr(model_class, "__name__", model_class)
        return CheckpointError(
            f"{os.fspath(path)!r} is a file and model_class={name!r} does not give its config (widths, layers): pass "
            f"config= too, eqxdiff.load(file, model_class={name!r}, config=config_or_folder), or the model's folder "
            "(the one holding config.json)")
    return CheckpointError(
        f"{os.fspath(path)!r} is a file; pass the model's folder (the one holding config.json), or say what the file "
        "holds: eqxdiff.load(file, model_class='CLIPTextModel', config=config_or_folder, conversion=rules)")


def _config_source(config, subfolder: str | None, revision: str | None) -> ModelConfig | Mapping:
    """``load``'s ``config`` argument as a config object or a dict: paths and Hub ids are read."""
    if isinstance(config, (ModelConfig, Mapping)):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise CheckpointError(f"config={config!r}: pass a config object, a dict, a config.json path, or a folder "
                              "or Hub id holding config.json")
    path = Path(os.fspath(config)).expanduser()
    if path.is_file():
        return read_json(path)
    return read_config(resolve_folder(config, subfolder, revision=revision))


def _class_and_config(source: ModelConfig | Mapping, described: str, model_class, overrides: Mapping):
    if model_class is None:
        if isinstance(source, ModelConfig):
            raise CheckpointError(f"a {type(source).__name__} object does not say which model it configures; pass "
                                  "model_class= too")
        cls = _class_named(class_name_of(source, described))
    elif isinstance(model_class, str):
        cls = _class_named(model_class)
    elif isinstance(model_class, type) and hasattr(model_class, "config_class"):
        cls = model_class
    else:
        raise CheckpointError(f"model_class={model_class!r}: pass a checkpoint class name such as 'CLIPTextModel' "
                              f"(eqxdiff can load {family_names('model')}) or an eqxdiff model class")
    fields = [f.name for f in dataclasses.fields(cls.config_class)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(f"config_overrides {unknown} are not settings of a {cls.config_class.__name__} "
                          f"({cls.__name__}); it has {fields}")
    if isinstance(source, ModelConfig):
        if not isinstance(source, cls.config_class):
            raise CheckpointError(f"{cls.__name__} takes a {cls.config_class.__name__}, not a "
                                  f"{type(source).__name__}")
        return cls, (cls.config_class.from_dict({**source.to_dict(), **overrides}) if overrides else source)
    try:
        return cls, cls.config_class.from_dict({**source, **overrides})
    except ConfigError as e:  # a value of the wrong type, or one eqxdiff does not implement: name the file
        raise ConfigError(f"{described}{f' with config_overrides {dict(overrides)}' if overrides else ''}: {e}"
                          ) from None


# The files a model folder's weights and config live in (any variant or shard of them): a save replaces these and
# keeps the folder's other entries (a LoRA file, a README ...).
_MODEL_FILE_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def _is_model_file(name: str) -> bool:
    return name == "config.json" or (name.startswith((*_WEIGHT_BASENAMES, "pytorch_model"))
                                     and name.endswith(_MODEL_FILE_SUFFIXES))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the temporary folder sits beside the target: the same file system
    except OSError:
        shutil.copy2(src, dst)


@contextlib.contextmanager
def replacing_folder(folder, *, keep=lambda name: True) -> Iterator[Path]:
    """Write a folder all at once: yields an empty temporary folder beside ``folder``; when the block ends without
    an error it replaces ``folder``, and an error leaves ``folder`` exactly as it was (the temporary one is
    removed). Entries of the old ``folder`` that the block did not write and ``keep(name)`` accepts are carried
    into the new one (hard links where possible), so files eqxdiff does not know about are never lost."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{os.fspath(folder)!r} is a file; pass a folder to save into (created if missing)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.saving-", dir=folder.parent))
    try:
        yield tmp
        if folder.is_dir():
            for entry in folder.iterdir():
                target = tmp / entry.name
                if target.exists() or not keep(entry.name):
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(entry, target) if not entry.is_symlink() else target.symlink_to(entry.readlink())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not folder.exists():
        tmp.rename(folder)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
    old.rmdir()
    folder.rename(old)
    try:
        tmp.rename(folder)
    except BaseException:
        old.rename(folder)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def save_pretrained(module, folder, *, dtype=None) -> Path:
    """Write ``module`` as a diffusers/transformers folder (config.json + safetensors) that they load again.

    The module and ``dtype`` are checked and every tensor gathered before anything is written; the files go into a
    temporary folder beside ``folder`` that replaces it at the end (:func:`replacing_folder`), so a save that fails
    leaves an existing ``folder`` loading as before. Its files other than weights and config.json are kept."""
    config_of = getattr(module, "checkpoint_config", None)
    if not callable(config_of):
        raise CheckpointError(f"save_pretrained needs an eqxdiff model (such as pipe.unet or the result of "
                              f"eqxdiff.load), got {type(module).__name__}; save a pipeline with save_pipeline")
    dt = check_dtype(dtype)
    config = json.dumps(config_of(), indent=2, sort_keys=True)
    tensors = convert_tensors(state_dict(module), inverse(fusion_rules(module)))
    if dt is not None:
        tensors = {k: v.astype(dt) if v.dtype.kind == "f" or v.dtype.name == "bfloat16" else v
                   for k, v in tensors.items()}
    base = "model" if getattr(module, "CHECKPOINT_FORMAT", "diffusers") == "transformers" else _WEIGHT_BASENAMES[0]
    with replacing_folder(folder, keep=lambda name: not _is_model_file(name)) as tmp:
        write_safetensors(tensors, tmp / f"{base}.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(config)
    return Path(folder)


__all__ = [
    "CheckpointError",
    "CheckpointFiles",
    "check_dtype",
    "class_name_of",
    "key_map_rules",
    "load",
    "model_class",
    "read_config",
    "read_json",
    "replacing_folder",
    "resolve_folder",
    "save_pretrained",
    "weight_files",
]
