"""``eqxdiff-generate``'s LoRA flags: ``--lora FILE_OR_HUB_ID[:SCALE]`` (repeatable), ``--fuse-lora``,
``--lora-max-rank``, ``--no-lora-strict`` and ``--lora-info FILE``.

- :func:`parse_specs` reads each ``--lora`` (the scale after the last ``:``, a file, a folder or a Hub id) and names
  its adapter after the file (``style.safetensors`` -> ``style``; a second ``style`` from another folder ->
  ``style_2``; the same file twice is refused).
- :func:`check_loras` runs, before the pipeline loads, every check loading would make: the file is there and is not
  a pickle, is for the ``--model`` pipeline's family, every key adapts a layer of its models (built abstractly from
  the folder's configs: no weight is read, :func:`abstract_models`) and fits ``--lora-max-rank``.
- :func:`apply_loras` loads them into the loaded pipeline (``load_lora_weights``, ``set_adapters`` with the scales,
  ``fuse_lora`` with ``--fuse-lora``) and returns what the outputs' metadata records of each (name, scale, the
  file's sha256; a Hub file's id, file name and revision).
- :func:`lora_info` prints ``eqxdiff.lora.inspect``'s report of a file (what adapts the ``--model`` pipeline too,
  when ``--model`` is given).

The adapters go on the ``--model`` pipeline (with its ``--controlnet`` nets and ``--unet``), not on a ``--refiner``.
"""

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import jax
import tyro

from ..loading import PICKLE_SUFFIXES, CheckpointError, check_dtype, model_class
from ..loading.lora import DEFAULT_WEIGHT_NAME, lora_path
from ..nn import build_abstract, scan_layers
from ..pipelines import InputError, lora
from ._command import one_line

FLAG = "--lora"
# A Hub id with the file in it: owner/name/path/in/repo.safetensors (owner/name alone: its pytorch_lora_weights).
_HUB = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(/.+)?")


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """LoRA / LyCORIS adapters on the --model pipeline, from any trainer's file (kohya / A1111 / civitai,
    diffusers / PEFT, LyCORIS LoHa / LoKr, ComfyUI, OneTrainer, ai-toolkit, XLabs ...)."""

    lora: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """A LoRA .safetensors file, a folder holding one, or a Hugging Face Hub id (owner/name for its
    pytorch_lora_weights.safetensors, owner/name/FILE.safetensors for another), with :SCALE its strength (default
    1; style.safetensors:0.8); repeat the flag for several. Each is named after its file and recorded with the
    outputs (name, scale, sha256)."""
    fuse_lora: bool = False
    """Merge the --lora adapters into the weights before generating (the plain model's program runs); without it
    they are added at run time."""
    lora_max_rank: int | None = None
    """Pad every --lora adapter to this rank (a file of a higher rank is refused), so that runs with other files
    of the same target layers and ranks up to it reuse the compiled program from the compilation cache."""
    lora_strict: bool = True
    """Refuse a --lora file holding keys that adapt nothing in the --model pipeline; --no-lora-strict loads the
    rest with a warning."""
    lora_info: str | None = None
    """Print what a LoRA file (or Hub id) is: format, family, target modules, ranks, alphas, adapter types and,
    when --model is given, what of it adapts that pipeline; then exit."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """One ``--lora``: as ``given``, its ``source`` (a local path or a Hub repository id, ``weight_name`` the file
    in it), ``scale`` and the adapter ``name``; ``file`` is the local ``.safetensors`` file once found."""

    given: str
    source: str
    weight_name: str | None
    hub: bool
    scale: float = 1.0
    name: str = ""
    file: str = ""

    def record(self) -> dict[str, Any]:
        """What the outputs' metadata notes of it: enough to find the very file again."""
        out: dict[str, Any] = {"name": self.name, "scale": self.scale}
        if self.hub:
            out.update(hub_id=self.source, weight_name=self.weight_name or DEFAULT_WEIGHT_NAME,
                       revision=_snapshot(self.file))
        else:
            out["path"] = self.source
        return {**out, "sha256": sha256(self.file)}


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _snapshot(file: str) -> str | None:
    """The commit a Hub file was fetched at (its cache path: ``.../snapshots/<commit>/<file>``)."""
    parts = Path(file).parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else None


def _source(text: str) -> tuple[str, str | None, bool]:
    """``(source, weight_name, hub)``: a local path, else a Hub id ``owner/name`` (its default file) or
    ``owner/name/FILE`` (``FILE`` in it). ``dir/style.safetensors`` is a path, found or not."""
    if Path(text).expanduser().exists() or text.startswith((".", "/", "~")) or not _HUB.fullmatch(text):
        return text, None, False
    owner, name, *rest = text.split("/")
    if not rest and name.lower().endswith((".safetensors", *PICKLE_SUFFIXES)):
        return text, None, False
    return f"{owner}/{name}", "/".join(rest) or None, True


def _scale(given: str) -> tuple[str, float]:
    """``FILE_OR_HUB_ID[:SCALE]`` split at its last ``:`` (a path that exists is taken whole)."""
    head, sep, tail = given.rpartition(":")
    if Path(given).expanduser().exists() or not sep or "/" in tail:
        return given, 1.0
    example = f"{head or 'style.safetensors'}:0.8"
    try:
        scale = float(tail)
    except ValueError:
        raise InputError(f"{FLAG} {given!r}: the scale {tail!r} after the last ':' is not a number; write "
                         f"FILE_OR_HUB_ID:SCALE, e.g. {example!r}") from None
    if not math.isfinite(scale):
        raise InputError(f"{FLAG} {given!r}: the scale {tail} is not finite; give a finite number, e.g. {example!r}")
    if not head:
        raise InputError(f"{FLAG} {given!r} names no file; write FILE_OR_HUB_ID:SCALE, e.g. {example!r}")
    return head, scale


def parse_specs(options: LoraOptions) -> list[LoraSpec]:
    """The ``--lora`` flags read (scales checked; files not yet looked at)."""
    if options.lora_max_rank is not None and options.lora_max_rank < 1:
        raise InputError(f"--lora-max-rank {options.lora_max_rank} must be >= 1 (the rank every adapter is padded "
                         "to)")
    if not options.lora:
        for flag, used in (("--fuse-lora", options.fuse_lora), ("--lora-max-rank", options.lora_max_rank)):
            if used:
                raise InputError(f"{flag} applies to --lora adapters; pass --lora FILE_OR_HUB_ID or leave {flag} out")
        return []
    specs = []
    for given in options.lora:
        text, scale = _scale(given)
        specs.append(LoraSpec(given, *_source(text), scale=scale))
    return specs


# -- before loading ---------------------------------------------------------------------------------------------------

# The Python API's words in loading's messages, as the command's flags.
_FLAG_WORDS = ((r"say which with weight_name=", "pass the file itself"),
               (r", or give weight_name=$", ", or name the file in it: owner/name/FILE.safetensors"),
               (r"strict=False", "--no-lora-strict"),
               (r"raise max_rank to", "raise --lora-max-rank to"),
               (r"does not fit max_rank=(\d+)", r"does not fit --lora-max-rank \1"),
               (r"eqxdiff\.lora\.inspect\(file\)", "--lora-info FILE"),
               (r"load it into an? (.+?) pipeline", r"use it with a \1 --model"))


def in_flags(message: str) -> str:
    for pattern, replacement in _FLAG_WORDS:
        message = re.sub(pattern, replacement, message)
    return one_line(message)


def _pickle_error(flag: str, spec: LoraSpec) -> CheckpointError:
    stem = Path(spec.source).stem
    return CheckpointError(
        f"{flag} {spec.given!r} is a PyTorch pickle; eqxdiff reads only .safetensors files (a pickle can run code "
        f"when loaded). Convert it once where you trust it: `sd = torch.load({spec.source!r}, map_location='cpu', "
        f"weights_only=True); safetensors.torch.save_file({{k: v.contiguous() for k, v in sd.items() if "
        f"torch.is_tensor(v)}}, '{stem}.safetensors')`")


def locate(flag: str, spec: LoraSpec) -> LoraSpec:
    """``spec`` with its local ``file`` (a Hub file fetched into the cache); a missing file, a pickle or a file of
    another kind is refused naming the flag."""
    local = Path(spec.source).expanduser()
    if Path((spec.weight_name or "") if spec.hub else spec.source).suffix.lower() in PICKLE_SUFFIXES:
        raise _pickle_error(flag, spec)
    if not spec.hub and not local.exists():
        raise FileNotFoundError(f"{flag} {spec.given!r}: no such file or folder; pass a LoRA .safetensors file, a "
                                "folder holding one, or a Hugging Face Hub id (owner/name, or "
                                "owner/name/FILE.safetensors)")
    try:
        found = lora_path(spec.source, weight_name=spec.weight_name)
    except CheckpointError as e:
        raise CheckpointError(f"{flag} {spec.given!r}: {in_flags(str(e))}") from None
    if found.suffix.lower() in PICKLE_SUFFIXES:
        raise _pickle_error(flag, spec)
    return dataclasses.replace(spec, file=os.fspath(found))


def _stem(spec: LoraSpec) -> str:
    """The adapter name a file gives: its stem, or for diffusers' ``pytorch_lora_weights`` its folder's (or Hub
    repository's) name."""
    stem = Path(spec.file).stem
    if stem == Path(DEFAULT_WEIGHT_NAME).stem:
        return spec.source.rstrip("/").rsplit("/", 1)[-1] if spec.hub else Path(spec.file).parent.name or stem
    return stem


def named(specs: Sequence[LoraSpec]) -> list[LoraSpec]:
    """``specs`` (located) named after their files, uniquely (``style``, ``style_2``); one file given twice is
    refused."""
    seen: dict[str, LoraSpec] = {}
    out, names = [], set()
    for spec in specs:
        real = os.path.realpath(spec.file)
        if real in seen:
            raise InputError(f"{FLAG} {seen[real].given!r} and {FLAG} {spec.given!r} name the same file; give it "
                             "once, with the scale you want")
        seen[real] = spec
        base = name = _stem(spec)
        i = 2
        while name in names:
            name, i = f"{base}_{i}", i + 1
        names.add(name)
        out.append(dataclasses.replace(spec, name=name))
    return out


def abstract_models(cls: type, read: Callable[[str], Mapping | None], *, dtype: str = "float32",
                    scan: bool = False) -> dict[str, Any]:
    """The models of a ``cls`` pipeline that its family's LoRA files name, built abstractly from the folder's
    configs (``read``: :func:`eqxdiff.cli._generate_flags.config_reader`'s; no weight is read or made); ``{}`` when
    a config is missing (a single file without ``--config``) or the family reads no LoRA files."""
    wanted, index = cls.lora_components(), read("model_index.json") or {}
    out = {}
    for component in cls.COMPONENTS:
        entry = index.get(component.name)
        if component.name not in wanted or (index and (not entry or entry[0] is None)):  # not in this folder
            continue
        raw, config = read(f"{component.name}/config.json"), cls.folder_config(read, component.name)
        if raw is None or config is None:
            return {}
        named_class = raw.get("_class_name") or (raw.get("architectures") or [None])[0]
        model = model_class(named_class or cls.component_classes(component)[0])

        def build(model=model, config=config, stacked=scan and component.scan):
            built = model(config, dtype=check_dtype(dtype), key=jax.random.key(0))
            return scan_layers(built) if stacked else built

        out[component.name] = build_abstract(build)
    return out


def check_loras(cls: type, specs: Sequence[LoraSpec], options: LoraOptions, models: Mapping[str, Any]
                ) -> list[LoraSpec]:
    """Every check loading would make of the ``--lora`` files on a ``cls`` pipeline whose LoRA-named ``models``
    (:func:`abstract_models`; ``{}``: the family check only) are given; returns the specs located and named."""
    if not cls.lora_components():
        raise InputError(f"{FLAG}: the --model folder's {cls.__name__} reads no LoRA files yet (its family declares "
                         f"no LoRA format); leave out {FLAG}")
    located = named([locate(FLAG, spec) for spec in specs])
    for spec in located:
        try:
            cls.check_lora_file(spec.file, models, strict=options.lora_strict, max_rank=options.lora_max_rank)
        except ValueError as e:
            raise type(e)(f"{FLAG} {spec.given!r}: {in_flags(str(e).removeprefix(f'{spec.file!r}: '))}") from None
    return located


# -- after loading ----------------------------------------------------------------------------------------------------

def apply_loras(pipe, specs: Sequence[LoraSpec], options: LoraOptions) -> list[dict[str, Any]]:
    """Load the checked ``--lora`` files into ``pipe`` at their scales (fused with ``--fuse-lora``); returns the
    metadata records (:meth:`LoraSpec.record`)."""
    for spec in specs:
        try:
            pipe.load_lora_weights(spec.file, adapter_name=spec.name, strict=options.lora_strict,
                                   max_rank=options.lora_max_rank)
        except ValueError as e:
            raise type(e)(f"{FLAG} {spec.given!r}: {in_flags(str(e))}") from None
    if not specs:
        return []
    pipe.set_adapters([s.name for s in specs], [s.scale for s in specs])
    if options.fuse_lora:
        pipe.fuse_lora(components=list(pipe.get_list_adapters()))  # every model (diffusers' Flux default: transformer)
    return [s.record() for s in specs]


def lora_info(given: str, cls: type | None = None, models: Mapping[str, Any] | None = None) -> str:
    """``--lora-info``'s report of ``given`` (a file, folder or Hub id), with what adapts a ``cls`` pipeline whose
    ``models`` are given (abstract ones do)."""
    flag = "--lora-info"
    spec = locate(flag, LoraSpec(given, *_source(given)))
    try:
        if cls is None or not models:
            return str(lora.inspect(spec.file))
        return str(lora.inspect(spec.file, cls, models=models))
    except ValueError as e:
        raise type(e)(f"{flag} {given!r}: {in_flags(str(e))}") from None
