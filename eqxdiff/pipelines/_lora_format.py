"""What a family declares about its LoRA files (:class:`LoraFormat`), and telling which family a file is for.

A pipeline class names its family's format in ``LORA_FORMAT`` (``"module:NAME"``, imported on first use); the
shared loader (:mod:`eqxdiff.pipelines._lora`) reads only that data. Wan's formats join with the Wan pipeline: a
``LoraFormat`` in its own file whose namings are ``diffusion_model.`` (original / ComfyUI / diffusion-pipe names,
a layout from its single-file rules), ``lora_unet_`` (musubi, underscored), ``transformer.`` (diffusers); lightx2v's
``diff`` / ``diff_b`` files are full differences the loader already reads.
"""

import dataclasses
import importlib
import re
from collections.abc import Callable, Iterable, Mapping

from ..core import FAMILY_TABLE, resolve_class
from ..loading.lora import NameLayout, Naming

# ``block_scales[component](model, spec)`` -> ``weight(module_name) -> float``: diffusers' per-block LoRA scales.
BlockScales = Callable[[object, object], Callable[[str], float]]


@dataclasses.dataclass(frozen=True)
class LoraFormat:
    """A family's LoRA files. ``family``: its name in messages; ``namings``: how file keys name its models
    (:class:`~eqxdiff.loading.lora.Naming`); ``layouts``: layouts beyond the models' own names
    (:class:`~eqxdiff.loading.lora.NameLayout`: single-file layouts, XLabs' names); ``markers``: regexes that tell
    one of its files among other families' (a key matching one is evidence for this family); ``block_scales``:
    per component, diffusers' per-block scales (``set_adapters`` weights as ``{"down": ..., "mid": ..., "up":
    ...}``); ``fuse_components``: the components ``fuse_lora()`` fuses by default, diffusers' defaults (``None``:
    every one holding adapters)."""

    family: str
    namings: tuple[Naming, ...]
    layouts: tuple[NameLayout, ...] = ()
    markers: tuple[str, ...] = ()
    block_scales: Mapping[str, BlockScales] = dataclasses.field(default_factory=dict)
    fuse_components: tuple[str, ...] | None = None

    def evidence(self, keys: Iterable[str]) -> list[str]:
        """The keys that look like this family's (its markers)."""
        patterns = [re.compile(m) for m in self.markers]
        return [k for k in keys if any(p.search(k) for p in patterns)]


def load_format(spec: str | LoraFormat | None) -> LoraFormat | None:
    """A ``LORA_FORMAT`` declaration (``"module:NAME"`` or the object) as the object."""
    if spec is None or isinstance(spec, LoraFormat):
        return spec
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def all_formats() -> list[LoraFormat]:
    """Every family's LoRA format (the pipeline classes of the family table that declare one), each once."""
    seen: dict[str, LoraFormat] = {}
    for name in FAMILY_TABLE:
        cls = resolve_class(name)
        spec = getattr(cls, "LORA_FORMAT", None) if isinstance(cls, type) else None
        fmt = load_format(spec)
        if fmt is not None:
            seen.setdefault(fmt.family, fmt)
    return list(seen.values())


def detect_family(keys: Iterable[str], formats: Iterable[LoraFormat] | None = None) -> tuple[str | None, list[str]]:
    """``(family, evidence keys)``: the family most of the file's keys look like (by its markers), or ``None``."""
    keys = list(keys)
    best, evidence = None, []
    for fmt in all_formats() if formats is None else formats:
        found = fmt.evidence(keys)
        if len(found) > len(evidence):
            best, evidence = fmt.family, found
    return best, evidence


__all__ = ["BlockScales", "LoraFormat", "all_formats", "detect_family", "load_format"]
