"""``fuse_lora`` / ``unfuse_lora`` of :class:`~eqxdiff.pipelines._lora.LoraMixin`: adapters merged into the weights
(float32 sums cast back), per model as diffusers does (each model fuses its own active adapters unless
``adapter_names`` says which), and the unfused models given back byte for byte."""

from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np

from .. import nn


class LoraFuseMixin:
    """Fusing methods; the state and names come from :class:`~eqxdiff.pipelines._lora.LoraMixin`."""

    def fuse_lora(self, lora_scale: float = 1.0, components: Sequence[str] | None = None,
                  adapter_names: Sequence[str] | None = None, safe_fusing: bool = False) -> None:
        """Merge adapters into the weights (``W + lora_scale * change`` at their strengths, float32 sums cast back):
        the layers then compute as plain ones. ``adapter_names``: which, active or not (default: each model's active
        ones, if enabled, as diffusers), each times ``lora_scale`` (diffusers: active ones only, README);
        ``components``: where (default: diffusers', the format's ``fuse_components``); ``safe_fusing``: refuse
        non-finite weights. See unfuse_lora."""
        state = self._lora()
        if state.fused:
            raise ValueError(f"adapters {state.fused_names()} are fused already; unfuse_lora() first")
        default = self._lora_format().fuse_components or state.slots  # diffusers' defaults (Flux: the transformer)
        comps = [c for c in state.slots if c in default] if components is None else list(components)
        unknown = sorted(set(comps) - set(state.slots))
        if unknown:
            raise ValueError(f"fuse_lora: components {unknown} hold no adapters; those that do: {list(state.slots)}")
        if adapter_names is None:
            names_of = {c: list(state.active_in(c)) if state.enabled else [] for c in comps}
        else:
            names = self._check_names(adapter_names, "fuse_lora")
            names_of = {c: [n for n in names if c in state.adapters[n].sites] for c in comps}
        names_of = {c: names for c, names in names_of.items() if names}
        if not names_of:
            raise ValueError("fuse_lora: no adapter to fuse (none is active in the models fused); set_adapters() or "
                             "name adapter_names")
        fused_models = {}
        for component, names in names_of.items():
            fused_models[component] = self._fuse_one(component, getattr(self, component), names, lora_scale)
            if safe_fusing and not all(bool(np.all(np.isfinite(np.asarray(x))))
                                       for x in jax.tree.leaves(eqx.filter(fused_models[component], eqx.is_array))):
                raise ValueError(f"fuse_lora(safe_fusing=True): {component} has non-finite weights once fused; "
                                 "nothing was fused")
        for component, fused in fused_models.items():
            state.unfused[component] = getattr(self, component)
            setattr(self, component, fused)
        state.fused = names_of

    def _fuse_one(self, component: str, model, names: Sequence[str], lora_scale: float):
        slots = self._lora().slots[component]
        to_fuse, to_keep = {}, {}
        for path, held in slots.items():
            adapters = nn.resolve_site(model, path).adapters
            fuse = [held.index(n) for n in names if n in held]  # in names' order, as PEFT merges them
            keep = [i for i, n in enumerate(held) if n not in names]
            sub = nn.entries_kept(adapters, fuse)
            if sub is not None:
                scales = nn.place_like(np.asarray(sub.scales) * np.float32(lora_scale), sub.scales)
                sub = nn.Adapters(sub.entries, scales, np.ones(np.shape(sub.enabled), np.float32))  # named: fused
            to_fuse[path], to_keep[path] = sub, nn.entries_kept(adapters, keep)
        fused = nn.fuse_adapters(nn.with_adapters(model, to_fuse), how="host" if self.mesh is None else "jit")
        return nn.with_adapters(fused, {p: a for p, a in to_keep.items() if a is not None})

    def unfuse_lora(self, components: Sequence[str] | None = None) -> None:
        """Give back the models :meth:`fuse_lora` replaced, exactly (their original arrays)."""
        state = self._lora()
        for component in [c for c in (state.unfused if components is None else components) if c in state.unfused]:
            setattr(self, component, state.unfused.pop(component))
            state.fused.pop(component, None)


__all__ = ["LoraFuseMixin"]
