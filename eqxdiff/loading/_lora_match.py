"""Which layer of which model each module of a LoRA file adapts, and the adapters that makes, per layer.

A family declares how files name its models (:class:`Naming`: a key prefix, the model it names, the layout of
the names after it, dots or kohya's underscores) and the layouts beyond its models' own names (:class:`NameLayout`:
conversion rules from the model's names, e.g. a single-file layout, and aliases for names no rule gives, e.g.
XLabs' ``processor.qkv_lora1``). :class:`Matcher` finds each :class:`~eqxdiff.loading.Record`'s layers through
:func:`~eqxdiff.loading.layer_index`; :func:`site_adapters` builds the adapters per layer (pieces cut from a fused
file tensor, joined into a fused layer, stacked over a scanned stack).
"""

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence

import equinox as eqx
import jax
import numpy as np

from .. import nn
from ..core import replace_static
from ._convert import Rule
from ._errors import CheckpointError
from ._lora_build import assemble, build_adapter, file_scale, rows_of
from ._lora_file import Record, peft_alpha
from ._lora_names import Run, try_layer_index
from ._view import fill, template_pattern


@dataclasses.dataclass(frozen=True)
class Naming:
    """Keys starting with ``prefix`` name modules of model ``component``: in ``layout`` (a :class:`NameLayout` the
    family declares; ``""``: the model's own names, diffusers' / transformers'), with dots or, ``underscored``,
    kohya's underscores. ``label`` names the naming in reports (``"kohya"``, ``"PEFT"`` ...)."""

    prefix: str
    component: str
    layout: str = ""
    underscored: bool = False
    label: str = ""


@dataclasses.dataclass(frozen=True)
class NameLayout:
    """Another layout of a model's names: ``rules(model)`` convert the model's checkpoint names to it (the inverse
    of the rules that load such a checkpoint); ``aliases`` are ``(file name template, layout name template)`` pairs
    for module names files use that no weight has (XLabs' ``double_blocks.{i}.processor.qkv_lora1`` ->
    ``double_blocks.{i}.img_attn.qkv``). ``label``: its name in reports."""

    name: str
    rules: Callable[[object], Sequence[Rule]]
    aliases: tuple[tuple[str, str], ...] = ()
    label: str = ""


@dataclasses.dataclass
class Match:
    """A record and where it goes: ``naming``, its module ``name`` within the model, and the layers' ``runs``."""

    record: Record
    naming: Naming
    name: str
    runs: list[Run]


class Matcher:
    """Resolves module keys against ``models`` (component name -> model) with ``namings`` (tried longest prefix
    first, then in their order) and ``layouts`` (by name). Indexes are built on first use."""

    def __init__(self, models: Mapping[str, object], namings: Sequence[Naming], layouts: Sequence[NameLayout] = ()):
        self.models = {k: v for k, v in models.items() if v is not None}
        self.namings = sorted((n for n in namings if n.component in self.models), key=lambda n: -len(n.prefix))
        self.layouts = {layout.name: layout for layout in layouts}
        self._indexes: dict[tuple[str, str, bool], dict[str, list[Run]]] = {}

    def index(self, component: str, layout: str, underscored: bool) -> dict[str, list[Run]]:
        key = (component, layout, underscored)
        if key not in self._indexes:
            if underscored:
                self._indexes[key] = {k.replace(".", "_"): v for k, v in self.index(component, layout, False).items()}
            else:
                rules = self.layouts[layout].rules(self.models[component]) if layout else ()
                self._indexes[key] = try_layer_index(self.models[component], rules)
        return self._indexes[key]

    def _aliased(self, component: str, layout: str, name: str) -> list[str]:
        """``name`` and what it may stand for: through the layout's aliases, or (the model's own layout) through
        the model's ``CHECKPOINT_KEY_MAP`` (names another library version writes: transformers 5's CLIP drops
        ``text_model.``)."""
        out = [name]
        if not layout:
            mapped = name
            for pattern, replacement in getattr(type(self.models[component]), "CHECKPOINT_KEY_MAP", ()):
                mapped = re.sub(pattern, replacement, mapped)
            out.append(mapped)
        for source, target in self.layouts[layout].aliases if layout else ():
            m = template_pattern(source).fullmatch(name)
            if m:
                out.append(fill(target, m.groupdict()))
        return out

    def resolve(self, key: str) -> tuple[Naming, str, list[Run]] | None:
        for naming in self.namings:
            if not key.startswith(naming.prefix):
                continue
            name = key[len(naming.prefix):]
            index = self.index(naming.component, naming.layout, naming.underscored)
            for candidate in self._aliased(naming.component, naming.layout, name):
                if candidate in index:
                    return naming, name, index[candidate]
        return None

    def match(self, records: Sequence[Record]) -> tuple[list[Match], list[Record]]:
        """``(matched, unmatched)`` records."""
        matched, unmatched = [], []
        for rec in records:
            found = self.resolve(rec.key)
            if found is None:
                unmatched.append(rec)
            else:
                matched.append(Match(rec, *found))
        return matched, unmatched


def _with_axes(adapter: nn.Adapter, axes) -> nn.Adapter:
    if isinstance(adapter, nn.DoRA):
        return replace_static(adapter, axes=axes, adapter=_with_axes(adapter.adapter, axes))
    return replace_static(adapter, axes=axes)


def _pieces(match: Match, config: Mapping, dtype_of: Callable[[nn.Site], np.dtype]):
    """``[(site, layer, first row, adapter)]``: the record's adapter cut into the rows of each layer it covers."""
    rec, runs = match.record, sorted(match.runs, key=lambda r: r.start)
    where = f"{match.naming.component} module {match.name!r}"
    first = runs[0].site
    for run in runs[1:]:
        if run.site.shape[1:] != first.shape[1:]:
            raise CheckpointError(f"{where} spans layers of different input shapes; it cannot be one adapter")
    peft = peft_alpha(config, match.naming.component, match.name) if rec.alpha is None else (None, False)
    adapter = build_adapter(rec, first.shape, first.axes, scale=file_scale(rec, peft), dtype=dtype_of(first),
                            where=where)
    rows = adapter.shape[0]
    covered = runs[-1].start + runs[-1].length
    if rows > covered or runs[0].start != 0:
        raise CheckpointError(f"{where}: the file's adapter changes {rows} output rows but the layer(s) it names have "
                              f"{covered}: the file is for another size of this model")
    out = []
    for run in runs:
        lo, hi = run.start, min(run.start + run.length, rows)
        if lo < hi:
            piece = rows_of(adapter, lo, hi)
            out.append((run.site, run.layer, run.row, _with_axes(piece, run.site.axes)))
    return out


def site_adapters(matches: Sequence[Match], config: Mapping, dtype_of: Callable[[nn.Site], np.dtype], *,
                  max_rank: int | None = None) -> dict[str, dict[nn.Site, nn.Adapter]]:
    """Component -> site -> the one adapter this file puts there (NumPy leaves; a stacked site's with a leading
    layers axis, zeros in the layers the file skips; ranks padded to ``max_rank`` if given). ``config``: the file's
    PEFT ``LoraConfig`` metadata (alphas)."""
    grouped: dict[str, dict[nn.Site, dict[int | None, list]]] = {}
    for m in matches:
        for site, layer, row, piece in _pieces(m, config, dtype_of):
            grouped.setdefault(m.naming.component, {}).setdefault(site, {}).setdefault(layer, []).append((row, piece))
    out: dict[str, dict[nn.Site, nn.Adapter]] = {}
    for component, sites in grouped.items():
        for site, layers in sites.items():
            where = f"{component} layer {site.name!r}"
            built = {layer: assemble(pieces, site.shape, site.axes, where) for layer, pieces in layers.items()}
            if site.layers is None:
                adapter = built[None]
                if max_rank is not None:
                    adapter = nn.harmonise_adapters([adapter], max_rank)[0]
            else:
                adapter = nn.stack_adapter_layers([built.get(i) for i in range(site.layers)], max_rank)
            out.setdefault(component, {})[site] = adapter
    return out


def same_structure(a: nn.Adapter, b: nn.Adapter) -> bool:
    """Whether two adapters fit one compiled program (one structure, one set of shapes and dtypes)."""
    la, lb = eqx.filter(a, eqx.is_array_like), eqx.filter(b, eqx.is_array_like)
    if jax.tree.structure(la) != jax.tree.structure(lb):
        return False
    return all(np.shape(x) == np.shape(y) and np.dtype(x.dtype) == np.dtype(y.dtype)
               for x, y in zip(jax.tree.leaves(la), jax.tree.leaves(lb)))


__all__ = ["NameLayout", "Match", "Matcher", "Naming", "same_structure", "site_adapters"]
