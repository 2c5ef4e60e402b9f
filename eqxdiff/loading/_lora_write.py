"""Writing LoRA files: the inverse of the readers (:mod:`._lora_file`, :mod:`._lora_match`).

A model's adapters (one LoRA, or a PEFT DoRA around one, per layer: what ``eqxdiff.train`` trains) are written under
the names a :class:`~eqxdiff.loading.lora.Naming` gives them, the names the readers resolve: the model's own
(diffusers / transformers) names, or another layout's through the same conversion rules the readers run
(:func:`~eqxdiff.loading.layer_index`), so a layer the layout fuses (Black Forest Labs' ``img_attn.qkv`` over
``to_q``, ``to_k``, ``to_v``) gets one LoRA over the fused rows: the layers' ``down`` stacked, their ``up`` block
diagonal (the inverse of how a reader cuts such a tensor into rows).

Two key styles: ``"peft"`` (diffusers' ``save_lora_weights``: ``<prefix><module>.lora_A.weight`` / ``lora_B.weight``
/ ``lora_magnitude_vector``, the rank and alpha in the ``lora_adapter_metadata`` header as diffusers writes them)
and ``"kohya"`` (``<prefix><module_with_underscores>.lora_down.weight`` / ``lora_up.weight`` / ``alpha`` /
``dora_scale``).
"""

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from .. import nn
from ._lora_file import METADATA_KEY
from ._lora_match import NameLayout, Naming
from ._lora_names import Run, layer_index
from ._safetensors import write_safetensors

STYLES = ("peft", "kohya")
_KEYS = {"peft": (".lora_A.weight", ".lora_B.weight", ".lora_B.bias", ".lora_magnitude_vector.weight"),
         "kohya": (".lora_down.weight", ".lora_up.weight", None, ".dora_scale")}


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One layer's adapter (host arrays) and the strength it runs at."""

    adapter: nn.LoRA | nn.DoRA
    strength: float

    @property
    def lora(self) -> nn.LoRA:
        return self.adapter.adapter if isinstance(self.adapter, nn.DoRA) else self.adapter


def _host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # a weight sharded over several hosts
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _check_kind(adapter, where: str) -> None:
    inner = adapter.adapter if isinstance(adapter, nn.DoRA) else adapter
    if isinstance(adapter, nn.DoRA) and (adapter.mode != "peft" or not adapter.rows):
        raise ValueError(f"{where}: a LyCORIS-style DoRA (dora_scale) cannot be written; eqxdiff writes PEFT's DoRA "
                         "(a magnitude per output row)")
    if not isinstance(inner, nn.LoRA) or inner.mid is not None:
        raise ValueError(f"{where} holds a {nn.describe_adapter(adapter)}; eqxdiff writes LoRA and DoRA adapters "
                         "(no LyCORIS kinds, no Tucker mid)")


def layer_adapters(model) -> dict[tuple, _Layer]:
    """``{(site path, layer index or None): _Layer}`` of every layer of ``model`` holding one adapter (host arrays,
    a stacked site's cut per layer); ``ValueError`` for a layer holding several, or a kind eqxdiff does not write."""
    out = {}
    for site in nn.adapter_sites(model):
        slot = nn.resolve_site(model, site).adapters
        if slot is None:
            continue
        if len(slot.entries) != 1:
            raise ValueError(f"layer {site.name!r} holds {len(slot.entries)} adapters; a file holds one per layer "
                             "(fuse or delete the others first)")
        _check_kind(slot.entries[0], f"layer {site.name!r}")
        adapter = jax.tree.map(_host, slot.entries[0])
        strength = _host(slot.scales)[..., 0] * _host(slot.enabled)[..., 0]
        if site.layers is None:
            out[(site.path, None)] = _Layer(adapter, float(strength))
        else:
            for i in range(site.layers):
                out[(site.path, i)] = _Layer(jax.tree.map(lambda x, i=i: x[i], adapter), float(strength[i]))
    return out


def _whole(runs: Sequence[Run], layer: _Layer) -> bool:
    """Whether ``runs`` name exactly one layer, all of its rows, in order."""
    run = runs[0]
    return len(runs) == 1 and run.start == 0 and run.row == 0 and run.length == layer.adapter.shape[0]


def _joined(name: str, runs: Sequence[Run], layers: Mapping[tuple, _Layer]) -> dict:
    """One LoRA (strengths folded in) over the rows ``runs`` give a fused tensor: the layers' ``down`` stacked, each
    run's rows of its layer's ``up`` in its own columns."""
    keys = list(dict.fromkeys((r.site.path, r.layer) for r in runs if (r.site.path, r.layer) in layers))
    if any(isinstance(layers[k].adapter, nn.DoRA) for k in keys):
        raise ValueError(f"module {name!r} fuses several layers in this layout, and a DoRA's norms cannot be split "
                         "between them; write the file in the model's own names (PEFT)")
    ranks = [layers[k].lora.rank for k in keys]
    cols = dict(zip(keys, np.cumsum([0, *ranks[:-1]]).tolist()))
    rows = max(r.start + r.length for r in runs)
    first = layers[keys[0]].lora
    up = np.zeros((rows, sum(ranks)), np.float32)
    has_bias = any(layers[k].lora.bias is not None for k in keys)
    bias = np.zeros((rows,), np.float32) if has_bias else None
    for run in runs:
        layer = layers.get((run.site.path, run.layer))
        if layer is None:
            continue
        lora, col, lo = layer.lora, cols[(run.site.path, run.layer)], run.row
        up[run.start:run.start + run.length, col:col + lora.rank] = \
            np.asarray(lora.up, np.float32)[lo:lo + run.length] * layer.strength
        if lora.bias is not None:
            bias[run.start:run.start + run.length] = np.asarray(lora.bias, np.float32)[lo:lo + run.length] * \
                layer.strength
    down = np.concatenate([np.asarray(layers[k].lora.down, np.float32) for k in keys])
    return {"down": down, "up": up, "bias": bias, "magnitude": None, "alpha": float(sum(ranks)),
            "kernel": len(first.shape) - 2}


def _single(name: str, layer: _Layer, alpha: float | None) -> dict:
    """A layer's own LoRA (and DoRA magnitude); ``alpha=None``: its strength folded into ``up`` and the file's
    alpha its rank (scale 1), else the tensors as they are with ``alpha`` (their strength must be alpha / rank)."""
    lora = layer.lora
    up, bias = np.asarray(lora.up, np.float32), None if lora.bias is None else np.asarray(lora.bias, np.float32)
    if alpha is None:
        up = up * layer.strength
        bias = None if bias is None else bias * layer.strength
        alpha = float(lora.rank)
    elif not math.isclose(layer.strength, alpha / lora.rank, rel_tol=1e-6):
        raise ValueError(f"module {name!r} runs at strength {layer.strength}, not alpha / rank = {alpha} / "
                         f"{lora.rank}; write it with alpha=None (its strength folded in)")
    magnitude = layer.adapter.magnitude if isinstance(layer.adapter, nn.DoRA) else None
    return {"down": np.asarray(lora.down, np.float32), "up": up, "bias": bias, "alpha": float(alpha),
            "magnitude": None if magnitude is None else np.asarray(magnitude, np.float32),
            "kernel": len(lora.shape) - 2}


def _emit(key: str, module: dict, style: str, dtype) -> dict[str, np.ndarray]:
    a, b, b_bias, mag = _KEYS[style]
    rank, kernel = module["down"].shape[0], module["kernel"]
    out = {key + a: module["down"], key + b: module["up"].reshape(-1, rank, *(1,) * kernel)}
    if module["bias"] is not None:
        if b_bias is None:
            raise ValueError(f"{key}: kohya's layout has no LoRA bias (PEFT's lora_B.bias); write it as PEFT")
        out[key + b_bias] = module["bias"]
    if module["magnitude"] is not None:  # PEFT: [out] (Linear), [1, out, 1, 1] (conv); LyCORIS: [out, 1, ...]
        m = module["magnitude"].reshape(-1)
        if style == "kohya":
            m = m.reshape(-1, 1, *(1,) * kernel)
        elif kernel:
            m = m.reshape(1, -1, *(1,) * kernel)
        out[key + mag] = m
    if style == "kohya":
        out[key + ".alpha"] = np.asarray(module["alpha"], np.float32)
    return {k: v if k.endswith(".alpha") else v.astype(dtype) for k, v in out.items()}


def lora_tensors(models: Mapping[str, object], namings: Sequence[Naming], layouts: Sequence[NameLayout] = (), *,
                 style: str = "peft", alpha: float | None = None, dtype=np.float32
                 ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(tensors, metadata)`` of a LoRA file holding the adapters in ``models`` (component name -> model), each
    component's under the one of ``namings`` naming it (its prefix, layout and underscores; ``layouts``: the
    :class:`NameLayout` s those name), in ``style`` (``"peft"`` or ``"kohya"``). ``alpha``: the alpha of every
    module (their strengths must be ``alpha / rank``), or ``None``: each strength folded into ``up`` (alpha = rank).
    Reading the file back gives the same changes."""
    if style not in STYLES:
        raise ValueError(f"style={style!r}; choose one of {STYLES}")
    by_name = {layout.name: layout for layout in layouts}
    tensors, metadata = {}, {}
    for component, model in models.items():
        naming = next((n for n in namings if n.component == component), None)
        if naming is None:
            raise ValueError(f"no naming for component {component!r} among {[n.component for n in namings]}")
        layers = layer_adapters(model)
        if not layers:
            continue
        rules = by_name[naming.layout].rules(model) if naming.layout else ()
        written, covered = {}, set()
        index = layer_index(model, rules)
        for name, runs in index.items():
            keys = {(r.site.path, r.layer) for r in runs} & layers.keys()
            if not keys:
                continue
            covered |= keys
            layer = layers.get((runs[0].site.path, runs[0].layer))
            module = _single(name, layer, alpha) if layer is not None and _whole(runs, layer) else \
                _joined(name, runs, layers)
            key = naming.prefix + (name.replace(".", "_") if naming.underscored else name)
            tensors.update(_emit(key, module, style, np.dtype(dtype)))
            written[name] = module
        if layers.keys() - covered:
            raise ValueError(f"{component}: {len(layers.keys() - covered)} adapted layers have no name in the "
                             f"{naming.label or naming.layout or 'model'}'s layout")
        if style == "peft":
            metadata.update(_peft_config(component, written, index))
    meta = {"format": "pt"}
    if metadata:
        meta[METADATA_KEY] = json.dumps(metadata, sort_keys=True)
    return tensors, meta


def _suffixes(names) -> dict[str, int]:
    """How many of ``names`` end with each dotted suffix (PEFT matches a target ``t`` to ``key == t`` or a key
    ending in ``.t``)."""
    counts: dict[str, int] = {}
    for name in names:
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            counts[suffix] = counts.get(suffix, 0) + 1
    return counts


def _short_names(written, everything, *, unique: bool) -> dict[str, str]:
    """The shortest dotted suffix of each written module name that PEFT matches to written modules only (every
    module of the model ending in it is written; ``unique``: to that module alone), never a bare layer number: PEFT
    matches module names, which may differ before it (transformers 5's CLIP drops ``text_model.``)."""
    total, mine = _suffixes(everything), _suffixes(written)
    out = {}
    for name in written:
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if parts[-1].isdigit() and k == 1:
                continue
            if total.get(suffix, 0) == (1 if unique else mine[suffix]):
                out[name] = suffix
                break
        else:
            out[name] = name
    return out


def _peft_config(component: str, modules: Mapping[str, dict], everything) -> dict:
    """diffusers' ``lora_adapter_metadata`` of one component (PEFT's ``LoraConfig`` as kwargs, keys prefixed with
    ``component.``): the most common rank and alpha, the others as patterns, the target modules as the shortest
    name suffixes matching the written modules only (``everything``: every adaptable module's name)."""
    ranks = {n: int(m["down"].shape[0]) for n, m in modules.items()}
    alphas = {n: m["alpha"] for n, m in modules.items()}
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    a = max(set(alphas.values()), key=list(alphas.values()).count)
    unique = _short_names(modules, everything, unique=True)
    config = {"r": r, "lora_alpha": a,
              "target_modules": sorted(set(_short_names(modules, everything, unique=False).values())),
              "rank_pattern": {re.escape(unique[n]): v for n, v in ranks.items() if v != r},
              "alpha_pattern": {re.escape(unique[n]): v for n, v in alphas.items() if v != a},
              "use_dora": any(m["magnitude"] is not None for m in modules.values()),
              "lora_bias": any(m["bias"] is not None for m in modules.values())}
    return {f"{component}.{k}": v for k, v in config.items()}


def write_lora(path, models: Mapping[str, object], namings: Sequence[Naming], layouts: Sequence[NameLayout] = (), *,
               style: str = "peft", alpha: float | None = None, dtype=np.float32) -> str:
    """Write :func:`lora_tensors` to ``path`` (a ``.safetensors`` file; its folder is made); returns the path."""
    tensors, metadata = lora_tensors(models, namings, layouts, style=style, alpha=alpha, dtype=dtype)
    if not tensors:
        raise ValueError("the models hold no adapters: nothing to write")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_safetensors(tensors, path, metadata)
    return os.fspath(path)


__all__ = ["STYLES", "layer_adapters", "lora_tensors", "write_lora"]
