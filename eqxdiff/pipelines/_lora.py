"""LoRA and LyCORIS adapters on a pipeline, by diffusers' names: ``load_lora_weights``, ``set_adapters``,
``disable_lora`` / ``enable_lora``, ``delete_adapters``, ``fuse_lora`` / ``unfuse_lora``, ``unload_lora_weights``,
``get_active_adapters``, ``get_list_adapters``.

>>> pipe.load_lora_weights("pixel-art-xl.safetensors", adapter_name="pixel")
>>> pipe.load_lora_weights("owner/toy-face", weight_name="toy_face_sdxl.safetensors", adapter_name="toy")
>>> pipe.set_adapters(["pixel", "toy"], adapter_weights=[0.5, 1.0])   # compiles nothing
>>> images = pipe("a toy face, pixel art")

Every family's models hold the adapters in their layers' ``adapters`` slots (:mod:`eqxdiff.nn._adapters`), added
at call time with traced strengths: a new strength, switching adapters on or off, or another file of the same ranks
and targets (``hotswap=True``; ranks padded to ``max_rank=``) reuses the compiled denoising loop. ``fuse_lora``
merges them into the weights (float32 sums cast back) and ``unfuse_lora`` gives back the models as they were, byte
for byte (``unload_lora_weights`` keeps them merged, as diffusers). A family's ``LORA_FORMAT`` (a
:class:`~eqxdiff.pipelines._lora_format.LoraFormat`) says which models its files adapt, by which keys: no family here.
"""

import copy
import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import numpy as np

from .. import nn
from ..loading import AdaptersNotSavedWarning, CheckpointError, without_adapters
from ..loading.lora import Matcher, match_models, parse, read_lora, same_structure, site_adapters
from ..parallel import shard_params
from ._lora_check import LoraWarning, check_coverage, check_lora_file, lora_format, peft_order
from ._lora_check import listed as _listed
from ._lora_format import LoraFormat, load_format
from ._lora_fuse import LoraFuseMixin
from ._lora_scale import LoraScaleMixin
from ._lora_state import LoadedAdapter, LoraState, active_after_delete


class LoraMixin(LoraFuseMixin, LoraScaleMixin):
    """LoRA methods of :class:`~eqxdiff.pipelines.DiffusionPipeline` (see the module docstring)."""

    # "module:NAME" of the family's LoraFormat (None: the family reads no LoRA files)
    LORA_FORMAT: ClassVar[str | None] = None

    # -- state -------------------------------------------------------------------------------------------------

    def _lora_format(self) -> LoraFormat:
        return lora_format(type(self))

    def _lora(self) -> LoraState:
        state = self.__dict__.get("_lora_state")
        if state is None:
            state = self.__dict__["_lora_state"] = LoraState()
        return state

    def _lora_models(self) -> dict[str, Any]:
        return {c.name: getattr(self, c.name) for c in self.COMPONENTS
                if c.kind == "model" and getattr(self, c.name, None) is not None}

    def _check_names(self, names, what: str) -> list[str]:
        names = [names] if isinstance(names, str) else list(names)
        known = self._lora().adapters
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"{what}: no adapter named {unknown}; loaded: {list(known)}")
        return names

    def _place_lora(self, component: str, model):
        """``model`` with its host (NumPy) adapter leaves placed as the component's weights are."""
        spec = next(c for c in self.COMPONENTS if c.name == component)
        if self.offload_encoders and spec.encoder:
            return model  # kept on the host with the encoder's weights (self.encoder() places both)
        if self.mesh is not None:
            return shard_params(model, self.mesh, self.rules)
        return jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, model)

    # -- loading -----------------------------------------------------------------------------------------------

    def load_lora_weights(self, path_or_hub_id, *, weight_name: str | None = None, adapter_name: str | None = None,
                          strict: bool = True, max_rank: int | None = None, hotswap: bool = False,
                          revision: str | None = None, into: Mapping[str, str] | None = None) -> str:
        """Load a LoRA / LyCORIS file (a ``.safetensors`` file, a folder holding one, or a Hub id with
        ``weight_name``) as adapter ``adapter_name`` (default ``default_N``) and make it the active one of the models
        it adapts; the other models' active adapters stay as they were (diffusers keeps them per model: a UNet-only
        file leaves the text encoder's adapter on; Wan's high- and low-noise files); returns the name. Any trainer's
        layout of the family's models is read (``LORA_FORMAT``).

        ``strict``: keys that adapt nothing here are an error listing them (``False``: one warning); a file for
        another family is an error naming it either way, and so is a file of which nothing applies. ``max_rank``:
        pad every rank to it, so that a later ``hotswap=True`` load of another file (of ranks up to it) into this
        adapter compiles nothing. ``hotswap``: replace the values of the existing adapter ``adapter_name`` (same
        layers, ranks up to the padded ones) instead of adding one. ``into``: load what the file holds for a
        component into another model of this pipeline instead (``{"transformer": "transformer_2"}``: a family's
        keyword passes it, e.g. Wan's ``load_into_transformer_2``).

        Control LoRAs change more than adapters, as in diffusers: a layer whose ``lora_A`` reads more inputs than it
        has is widened with zero columns where the model declares that input widenable (``with_input_width``), and
        a norm's whole new scale (``.scale`` / ``.weight`` keys) is held as the difference from its value in the
        adapter's entry: it follows the adapter's strength and switch (diffusers writes it in whatever they are).
        ``unload_lora_weights`` gives back the models as they were, their widths and norms too."""
        fmt, state = self._lora_format(), self._lora()
        into = dict(into or {})
        models = self._lora_models()
        missing = sorted(target for target in into.values() if target not in models)
        if missing:
            raise ValueError(f"{type(self).__name__} has no model {missing} to load a LoRA into; it has "
                             f"{', '.join(models)}")
        if state.fused:
            raise ValueError(f"adapters {state.fused_names()} are fused into the weights; unfuse_lora() before loading "
                             "another file")
        name = self._adapter_name(adapter_name, hotswap)
        file = read_lora(path_or_hub_id, weight_name=weight_name, revision=revision)
        records, unknown = parse(file.tensors)
        models = {name: models[into.get(name, name)] for name in models}  # the file's names, the targets' models
        matched, unmatched, widened = match_models(lambda m: Matcher(m, fmt.namings, fmt.layouts), models, records)
        models.update(widened)  # a control LoRA's wider input layer
        check_coverage(fmt, type(self).__name__, list(models), file.path, file.tensors, matched, unmatched, unknown,
                       strict, stacklevel=3)
        if hotswap:
            max_rank = state.adapters[name].max_rank
        dtypes = {site: np.dtype(nn.resolve_site(model, site).weight.dtype) for model in models.values()
                  for site in nn.adapter_sites(model)}
        try:
            built = site_adapters(matched, file.peft_config(), dtypes.__getitem__, max_rank=max_rank)
        except ValueError as e:
            raise CheckpointError(f"{file.path!r}: {e}") from None
        built = {into.get(component, component): sites for component, sites in built.items()}
        if widened and hotswap:
            raise CheckpointError(f"{file.path!r} widens {sorted(widened)} (its adapters read more inputs than the "
                                  f"layers have): hotswap keeps the compiled program, so load it as another adapter")
        for component, model in widened.items():
            target = into.get(component, component)
            state.original.setdefault(target, getattr(self, target))
            setattr(self, target, model)
        if hotswap:
            self._hotswap(name, built)
        else:
            self._attach(name, built)
            state.adapters[name] = LoadedAdapter(name, file.path, {c: [s.path for s in sites]
                                                                   for c, sites in built.items()},
                                                 max_rank=max_rank, modules=len(matched))
            state.active.update({component: [name] for component in built})  # as PEFT: the new one, per model
        self._refresh_lora()
        return name

    def _adapter_name(self, adapter_name: str | None, hotswap: bool) -> str:
        adapters = self._lora().adapters
        if hotswap:
            if adapter_name not in adapters:
                raise ValueError(f"hotswap=True replaces a loaded adapter: give adapter_name= one of {list(adapters)}")
            return adapter_name
        if adapter_name is None:
            i = len(adapters)
            while f"default_{i}" in adapters:
                i += 1
            return f"default_{i}"
        if not isinstance(adapter_name, str) or not adapter_name:
            raise ValueError(f"adapter_name={adapter_name!r} must be a non-empty string")
        if adapter_name in adapters:
            raise ValueError(f"an adapter named {adapter_name!r} is already loaded; choose another adapter_name, "
                             "delete_adapters() it first, or hotswap=True to replace its values")
        return adapter_name

    def _attach(self, name: str, built: Mapping[str, Mapping[nn.Site, nn.Adapter]]) -> None:
        state = self._lora()
        for component, sites in built.items():
            model = getattr(self, component)
            state.original.setdefault(component, model)
            slots = state.slots.setdefault(component, {})
            changes = {}
            for site, adapter in sites.items():
                old = nn.resolve_site(model, site).adapters
                entries = (() if old is None else old.entries) + (adapter,)
                shape = (len(entries),) if site.layers is None else (site.layers, len(entries))
                changes[site.path] = nn.Adapters(entries, np.ones(shape, np.float32), np.ones(shape, np.float32))
                slots.setdefault(site.path, []).append(name)
            setattr(self, component, self._place_lora(component, nn.with_adapters(model, changes)))

    def _hotswap(self, name: str, built: Mapping[str, Mapping[nn.Site, nn.Adapter]]) -> None:
        state = self._lora()
        loaded = state.adapters[name]
        extra = sorted(set(built) - set(loaded.sites))
        if extra:
            raise CheckpointError(f"hotswap into {name!r}: the file adapts {extra}, which {name!r} does not; "
                                  "hotswapping replaces values only, in the layers the first file adapted")
        for component, paths in loaded.sites.items():
            model = getattr(self, component)
            new = {site.path: (site, a) for site, a in built.get(component, {}).items()}
            outside = [s.name for p, (s, _) in new.items() if p not in paths]
            if outside:
                raise CheckpointError(f"hotswap into {name!r}: the file adapts {_listed(outside)} of {component}, "
                                      f"which {name!r} does not; load it as another adapter instead")
            changes = {}
            for path in paths:
                adapters = nn.resolve_site(model, path).adapters
                i = state.slots[component][path].index(name)
                old = adapters.entries[i]
                site, fresh = new.get(path, (None, None))
                fresh = nn.zeros_adapter(old) if fresh is None else fresh
                if not same_structure(fresh, old):
                    where = site.name if site is not None else str(path)
                    raise CheckpointError(
                        f"hotswap into {name!r}: {component} layer {where!r} gets a {nn.describe_adapter(fresh)} "
                        f"where {name!r} holds a {nn.describe_adapter(old)}; hotswapping keeps the compiled program, "
                        f"so kinds and ranks must fit: load the first file with max_rank= the largest rank")
                fresh = jax.tree.map(nn.place_like, fresh, old)
                entries = adapters.entries[:i] + (fresh,) + adapters.entries[i + 1:]
                changes[path] = nn.Adapters(entries, adapters.scales, adapters.enabled)
            setattr(self, component, nn.with_adapters(model, changes))

    # -- strengths ---------------------------------------------------------------------------------------------

    def _weight_fn(self, name: str, component: str, model):
        """``module name -> strength`` of adapter ``name`` in ``component``."""
        weight = self._lora().adapters[name].weight
        components = set(self._lora_models())
        if isinstance(weight, Mapping) and set(weight) <= components:
            weight = weight.get(component, 1.0)
        elif isinstance(weight, Mapping):
            blocks = self._lora_format().block_scales
            if not blocks:
                raise ValueError(f"adapter weights {weight!r}: name components {sorted(components)} as keys; "
                                 f"{self._lora_format().family} has no per-block scales")
            weight = weight if component in blocks else 1.0
        if isinstance(weight, Mapping):
            blocks = self._lora_format().block_scales
            if component not in blocks:
                raise ValueError(f"per-block weights {weight!r} for {component}, which has no per-block scales; "
                                 f"give it one number")
            return blocks[component](model, weight)
        value = float(weight)
        return lambda module: value

    def _refresh_lora(self) -> None:
        """Every layer's traced strengths and switches from the adapters' weights, the active set (its order where
        PEFT DoRA entries compose) and ``enable_lora`` / ``disable_lora``: values only, placed where the old ones were.
        While fused, the fused models keep their unfused adapters' entries and the kept unfused models all of them."""
        state = self._lora()
        for component, slots in state.slots.items():
            fused_here, model = component in state.unfused, getattr(self, component)
            model = model if fused_here else peft_order(model, slots, state.active_in(component))
            fused = state.fused.get(component, [])
            current = {p: [n for n in names if n not in fused] for p, names in slots.items()}
            setattr(self, component, self._with_strengths(component, model, current))
            if fused_here:
                state.unfused[component] = self._with_strengths(component, state.unfused[component], slots)

    def _with_strengths(self, component: str, model, names_of: Mapping[tuple, list[str]]):
        state = self._lora()
        fns = {n: self._weight_fn(n, component, model) for names in names_of.values() for n in names}
        active = state.active_in(component)
        changes = {}
        for site in nn.adapter_sites(model):
            names = names_of.get(site.path)
            adapters = nn.resolve_site(model, site).adapters
            if not names or adapters is None:
                continue
            modules = site.names
            scales = np.asarray([[fns[n](m) for n in names] for m in modules], np.float32)
            on = np.asarray([[1.0 if state.enabled and n in active else 0.0 for n in names]] * len(modules),
                            np.float32)
            if site.layers is None:
                scales, on = scales[0], on[0]
            changes[site.path] = nn.Adapters(adapters.entries, nn.place_like(scales, adapters.scales),
                                             nn.place_like(on, adapters.enabled))
        return nn.with_adapters(model, changes)

    def set_adapters(self, adapter_names: str | Sequence[str], adapter_weights=None) -> None:
        """Make ``adapter_names`` the active adapters of every model, at ``adapter_weights`` (one per name, or one
        for all; default 1.0). A weight is a number, a dict by component (``{"unet": 0.8, "text_encoder": 0.5}``)
        or, for a family with per-block scales (the UNets), diffusers' block dict ``{"down": {"block_1": [0, 1]},
        "mid": 0.5, "up": ...}`` (under its component's key, or alone). Values only (a new order of DoRA adapters
        compiles)."""
        names = self._check_names(adapter_names, "set_adapters")
        if adapter_weights is None:
            weights = [1.0] * len(names)
        elif isinstance(adapter_weights, (int, float, Mapping)):
            weights = [adapter_weights] * len(names)
        else:
            weights = list(adapter_weights)
        if len(weights) != len(names):
            raise ValueError(f"set_adapters: {len(weights)} adapter_weights for {len(names)} adapter_names")
        state = self._lora()
        previous = {n: state.adapters[n].weight for n in names}
        for n, w in zip(names, weights):
            state.adapters[n].weight = 1.0 if w is None else w
        try:
            for component in state.slots:  # check every weight before changing anything
                for n in names:
                    self._weight_fn(n, component, getattr(self, component))
        except (ValueError, TypeError):
            for n, w in previous.items():
                state.adapters[n].weight = w
            raise
        state.active = {component: list(names) for component in state.slots}  # every model, as diffusers
        self._refresh_lora()

    def disable_lora(self) -> None:
        """Switch every adapter off (the models compute as without them; nothing compiles)."""
        self._lora().enabled = False
        self._refresh_lora()

    def enable_lora(self) -> None:
        """Switch the active adapters back on."""
        self._lora().enabled = True
        self._refresh_lora()

    def get_active_adapters(self) -> list[str]:
        """The adapters active in any model, each once (diffusers returns one model's list: the last LoRA-loadable
        model holding adapters); ``_lora().active`` has them per model."""
        return self._lora().active_names()

    def get_list_adapters(self) -> dict[str, list[str]]:
        """Component -> the adapters loaded into it."""
        out: dict[str, list[str]] = {}
        for loaded in self._lora().adapters.values():
            for component in loaded.sites:
                out.setdefault(component, []).append(loaded.name)
        return out

    def lora_adapters(self) -> list[dict]:
        """The loaded adapters as records (name, file, weight, active): what an output's metadata notes."""
        state = self._lora()
        active, fused = state.active_names(), state.fused_names()
        return [{"name": a.name, "path": a.path, "weight": a.weight, "active": state.enabled and a.name in active,
                 "fused": a.name in fused} for a in state.adapters.values()]

    def rewrite_lora_copies(self, component: str, change) -> None:
        """Apply ``change`` (model -> model: another feature's edit of ``component``, such as textual inversion's
        token rows or IP-Adapter's layers) to the copies of it the adapters keep (``unload_lora_weights``' original,
        ``unfuse_lora``'s unfused model), so that giving them back keeps the edit. The feature edits the current
        model itself."""
        state = self.__dict__.get("_lora_state")
        for copies in (state.original, state.unfused) if state is not None else ():
            if component in copies:
                copies[component] = change(copies[component])

    # -- sharing and saving ------------------------------------------------------------------------------------

    @classmethod
    def lora_components(cls) -> tuple[str, ...]:
        """The components this family's LoRA files adapt (its ``LORA_FORMAT``'s namings; ``()``: it reads none)."""
        fmt = load_format(cls.LORA_FORMAT)
        return () if fmt is None else tuple(dict.fromkeys(n.component for n in fmt.namings))

    @classmethod
    def check_lora_file(cls, path_or_hub_id, models: Mapping[str, Any] | None = None, **kwargs):
        """What :meth:`load_lora_weights` would refuse in a file, before a pipeline of this class is loaded:
        ``models`` (component -> model, abstract ones too) as :func:`~eqxdiff.pipelines._lora_check.check_lora_file`
        takes them (``weight_name``, ``revision``, ``strict``, ``max_rank``); returns the file read."""
        return check_lora_file(cls, path_or_hub_id, models, **kwargs)

    def _carry_lora(self, source, replaced: Mapping[str, Any]) -> None:
        """Take over ``source``'s adapters (:meth:`from_pipe`, :meth:`with_scheduler`) in the models this pipeline
        shares with it: those it has and that ``replaced`` (the components given anew) does not replace by other
        objects. A copy: switching adapters on one pipeline leaves the other's models and bookkeeping as they
        were."""
        theirs = source.__dict__.get("_lora_state") if isinstance(source, LoraMixin) else None
        if theirs is None or not theirs.adapters:
            return
        own = {c.name for c in self.COMPONENTS if c.kind == "model"}
        kept = {c for c in theirs.slots if c in own and replaced.get(c, getattr(source, c)) is getattr(source, c)}
        their_models = set(source._lora_models())
        state = LoraState(enabled=theirs.enabled)
        state.slots = {c: {p: list(names) for p, names in theirs.slots[c].items()} for c in kept}
        state.original = {c: m for c, m in theirs.original.items() if c in kept}
        state.unfused = {c: m for c, m in theirs.unfused.items() if c in kept}
        for name, loaded in theirs.adapters.items():
            sites = {c: list(paths) for c, paths in loaded.sites.items() if c in kept}
            weight = copy.deepcopy(loaded.weight)
            if isinstance(weight, Mapping) and set(weight) <= their_models:  # per component: the kept ones
                weight = {c: w for c, w in weight.items() if c in kept}
            if sites:
                state.adapters[name] = dataclasses.replace(loaded, sites=sites, weight=weight)
        state.active = {c: list(names) for c, names in theirs.active.items() if c in kept}
        state.fused = {c: list(names) for c, names in theirs.fused.items() if c in state.unfused}
        if state.adapters:
            self.__dict__["_lora_state"] = state

    def models_to_save(self) -> dict[str, Any]:
        """The models as :func:`~eqxdiff.pipelines.save_pipeline` writes them: adapters not fused into the weights
        are left out (a diffusers folder holds weights only), with one
        :class:`~eqxdiff.loading.AdaptersNotSavedWarning` naming them; fused ones are in the weights."""
        out, left = {}, []
        for component, model in self._lora_models().items():
            out[component], layers = without_adapters(model)
            if layers:
                left.append(component)
        if left:
            state = self._lora()
            names = [n for n, a in state.adapters.items()
                     if any(c in a.sites and n not in state.fused.get(c, []) for c in left)]
            warnings.warn(f"the adapters {names} are not fused into the weights of {', '.join(left)}: the saved "
                          "pipeline leaves them out (its folders hold weights only). To bake them in, "
                          f"pipe.fuse_lora(components={left}) before saving (unfuse_lora() after gives them back)",
                          AdaptersNotSavedWarning, stacklevel=3)
        return out

    # -- removing ----------------------------------------------------------------------------------------------

    def delete_adapters(self, adapter_names: str | Sequence[str]) -> None:
        """Remove adapters (their entries leave every layer: the models' structure changes); a model left without
        an active adapter makes its first one active, as diffusers (:func:`active_after_delete`)."""
        names = self._check_names(adapter_names, "delete_adapters")
        state = self._lora()
        if state.fused:
            raise ValueError("unfuse_lora() before deleting adapters")
        for component, slots in state.slots.items():
            model = getattr(self, component)
            changes = {}
            for path, held in list(slots.items()):
                keep = [i for i, n in enumerate(held) if n not in names]
                if len(keep) == len(held):
                    continue
                changes[path] = nn.entries_kept(nn.resolve_site(model, path).adapters, keep)
                slots[path] = [held[i] for i in keep]
                if not slots[path]:
                    del slots[path]
            setattr(self, component, nn.with_adapters(model, changes))
        state.active = active_after_delete(state.adapters, state.active, names)
        for n in names:
            del state.adapters[n]
        self.unload_lora_weights() if not state.adapters else self._refresh_lora()

    def unload_lora_weights(self) -> None:
        """Remove every adapter, as diffusers: each model is again the very object it was before the first load, but
        one :meth:`fuse_lora` merged adapters into keeps those weights, its other adapters gone (how a LoRA is baked
        in before saving; ``unfuse_lora()`` first gives the originals back)."""
        state = self._lora()
        for component, model in state.original.items():
            setattr(self, component, without_adapters(getattr(self, component))[0] if component in state.unfused
                    else model)
        self.__dict__["_lora_state"] = LoraState()


__all__ = ["LoadedAdapter", "LoraMixin", "LoraState", "LoraWarning"]
