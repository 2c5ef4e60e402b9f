"""A pipeline's LoRA bookkeeping: the loaded files (:class:`LoadedAdapter`) and, per model, which adapters each
layer holds, which are active and which are fused (:class:`LoraState`). Active and fused sets are kept per model,
as diffusers keeps them (PEFT's state lives in each model's layers): loading a file into the UNet makes it the
UNet's active adapter and leaves the text encoder's as they were."""

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ._lora_check import LoraWarning


@dataclasses.dataclass
class LoadedAdapter:
    """One loaded file: its ``name``, ``path``, the layers it adapts per component (``sites``: key paths), its
    ``weight`` (``set_adapters``'), ``max_rank`` it was padded to, and ``modules``: how many file modules matched."""

    name: str
    path: str
    sites: dict[str, list[tuple]]
    weight: Any = 1.0
    max_rank: int | None = None
    modules: int = 0


@dataclasses.dataclass
class LoraState:
    """A pipeline's adapters. ``slots[component][path]``: the adapter names of that layer's entries, in order;
    ``active[component]``: the adapters on in that model (diffusers' per-model active adapters); ``original``: the
    models before any adapter (restored by ``unload_lora_weights``); ``unfused``: the models ``fuse_lora`` replaced
    (restored by ``unfuse_lora``); ``fused[component]``: the adapters merged into that model's weights."""

    adapters: dict[str, LoadedAdapter] = dataclasses.field(default_factory=dict)
    slots: dict[str, dict[tuple, list[str]]] = dataclasses.field(default_factory=dict)
    active: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    enabled: bool = True
    original: dict[str, Any] = dataclasses.field(default_factory=dict)
    unfused: dict[str, Any] = dataclasses.field(default_factory=dict)
    fused: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def active_names(self) -> list[str]:
        """The adapters active in any model, each once, in the models' order."""
        return list(dict.fromkeys(n for names in self.active.values() for n in names))

    def fused_names(self) -> list[str]:
        """The adapters fused into any model's weights."""
        return list(dict.fromkeys(n for names in self.fused.values() for n in names))

    def active_in(self, component: str) -> list[str]:
        return self.active.get(component, [])


def active_after_delete(adapters: Mapping[str, LoadedAdapter], active: Mapping[str, Sequence[str]],
                        deleted: Sequence[str]) -> dict[str, list[str]]:
    """Each model's active adapters once ``deleted`` leave ``adapters`` (name -> loaded adapter, its ``sites`` by
    model): the rest of its active ones and, as PEFT's ``delete_adapter`` (so diffusers' ``delete_adapters``), where
    a model's active adapters all leave, the first adapter it still holds; one warning names them."""
    out, woken = {}, {}
    for component, names in sorted(active.items()):
        left = [n for n in names if n not in deleted]
        held = [n for n, a in adapters.items() if n not in deleted and component in a.sites]
        if not left and held and set(names) & set(deleted):
            left = [held[0]]
            woken.setdefault(held[0], []).append(component)
        if held:
            out[component] = left
    if woken:
        now = "; ".join(f"{name!r} in {', '.join(models)}" for name, models in woken.items())
        warnings.warn(f"deleted the active adapters of a model: the first adapter it still holds is active now, as in "
                      f"diffusers: {now}; set_adapters() chooses others", LoraWarning, stacklevel=3)
    return out


__all__ = ["LoadedAdapter", "LoraState", "active_after_delete"]
