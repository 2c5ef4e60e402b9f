"""The names a model's adaptable layers have in a file layout, and which rows of which layer each one covers.

A LoRA file names the layers it adapts as some layout names the weights: diffusers' (``...attn1.to_q``), a
family's single-file layout (SGM's ``input_blocks.4.1...``, Black Forest Labs' fused ``double_blocks.0.img_attn.qkv``),
a model's own fused projections (``attn.to_qkv``). Those layouts are already declared as conversion rules (for
loading checkpoints), so :func:`layer_index` reuses them instead of a second table: it runs the rules on a view of
the model's tensors whose values are tags (layer, row), never reading a weight, and reads which tagged rows each
converted tensor holds. A fused tensor (BFL's ``qkv``) comes out as several runs (``to_q`` rows, ``to_k`` rows ...),
a swapped one (the final modulation's shift/scale) as its two halves in their order.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..core import leaf_specs
from ..nn import Site, adapter_sites
from ._checkpoint import fusion_rules
from ._convert import Rule, convert, inverse
from ._errors import ConversionError
from ._lazy import LazyTensor, TensorDict

_SHIFT = 32  # tag = (layer id + 1) << 32 | row


@dataclasses.dataclass(frozen=True)
class Run:
    """Rows ``[start, start + length)`` of a named tensor are rows ``[row, row + length)`` of ``site``'s layer
    ``layer`` (``None``: not stacked)."""

    start: int
    length: int
    site: Site
    layer: int | None
    row: int


def _targets(model) -> list[tuple[Site, int | None, str]]:
    out = []
    for site in adapter_sites(model):
        for i, name in enumerate(site.names):
            out.append((site, None if site.layers is None else i, name))
    return out


def _tag_view(model, targets) -> TensorDict:
    """Every tensor of the model by its checkpoint name, as a zero-memory broadcast: a target weight holds the tag
    of each of its rows, everything else -1."""
    leaves, specs, _ = leaf_specs(model)
    tensors = {}
    for leaf, spec in zip(leaves, specs):
        shape = spec.torch_shape(tuple(leaf.shape))
        for name in spec.names:
            tensors[name] = np.broadcast_to(np.int64(-1), shape)
    for t, (site, _, name) in enumerate(targets):
        weight = next(n for n in (f"{name}.weight", f"{name}_weight", "weight", name) if n in tensors)
        rows = ((t + 1) << _SHIFT) + np.arange(site.shape[0], dtype=np.int64)
        tensors[weight] = np.broadcast_to(rows.reshape(-1, *(1,) * (len(site.shape) - 1)), site.shape)
    return TensorDict(tensors)


def _first_column(arr) -> np.ndarray:
    if arr.ndim == 0:
        return np.full((1,), -1, np.int64)
    box = (slice(None),) + (slice(0, 1),) * (arr.ndim - 1)
    col = arr[box] if isinstance(arr, LazyTensor) else np.asarray(arr[box])
    return np.asarray(col).reshape(arr.shape[0])


def _runs(tags: np.ndarray, targets) -> list[Run]:
    runs: list[Run] = []
    for start, tag in enumerate(tags):
        if tag < 0:
            continue
        t, row = int(tag >> _SHIFT) - 1, int(tag & ((1 << _SHIFT) - 1))
        last = runs[-1] if runs else None
        site, layer, _ = targets[t]
        if last and last.site is site and last.layer == layer and last.row + last.length == row \
                and last.start + last.length == start:
            runs[-1] = dataclasses.replace(last, length=last.length + 1)
        else:
            runs.append(Run(start, 1, site, layer, row))
    return runs


def _module(name: str) -> str:
    """The module a weight's name names (``.scale``: a norm's weight in Black Forest Labs' names); a parameter named
    as its module (a modulation table) is its own."""
    for suffix in (".weight", "_weight", ".scale"):
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def layer_index(model, rules: Sequence[Rule] = ()) -> dict[str, list[Run]]:
    """Module name -> the rows of ``model``'s adaptable layers it covers, for the layout ``rules`` convert the model's
    checkpoint names to (``()``: the model's own layout with any fused projections split back, diffusers' names).
    Raises :class:`~eqxdiff.loading.ConversionError` if the rules do not fit the model."""
    targets = _targets(model)
    view = convert(_tag_view(model, targets), (*inverse(fusion_rules(model)), *rules), where="model's layout")
    index = {}
    for name in view.names():
        runs = _runs(_first_column(view.get(name)), targets)
        if runs:
            index[_module(name)] = runs
    return index


def try_layer_index(model, rules: Sequence[Rule]) -> dict[str, list[Run]]:
    """:func:`layer_index`, or ``{}`` when the rules do not fit the model (a layout it cannot be written in)."""
    try:
        return layer_index(model, rules)
    except ConversionError:
        return {}


__all__ = ["Run", "layer_index", "try_layer_index"]
