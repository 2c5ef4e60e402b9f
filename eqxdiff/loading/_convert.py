"""Checkpoint conversions as data: a few rule dataclasses and the one converter that applies them.

A checkpoint written by another library (OpenCLIP, an A1111/ComfyUI single file, Black Forest Labs' Flux files, a
LoRA) holds the numbers eqxdiff reads under other names and layouts. A conversion is a sequence of rules applied in
turn to a *view* of the checkpoint, the ``names() / shape(name) / dtype(name) / get(name)`` mapping that
:func:`~eqxdiff.loading.fill_module` reads:

======================================  =============================================================================
``Rename(source, target)``              a tensor's name (exact, a prefix, or with captured parts such as layer indices)
``Split(source, targets, axis, sizes)`` a fused tensor (qkv, BFL's ``linear1``) into pieces; ``sizes`` ints, ``-1``
                                        for the rest, :class:`Dim` for a size read from a tensor; none: equal parts
``Concat(sources, target, axis)``       the inverse: pieces into one fused tensor (fused projections at load time)
``Reshape(source, shape)``              a new shape (``-1`` and :class:`Dim` entries allowed)
``Transpose(source, perm)``             a permuted layout (a projection stored transposed)
``SwapHalves(source, axis)``            the two halves of an axis swapped (Flux's final shift/scale order)
``Tie(source, targets)``                one stored tensor feeding several names (tied embeddings)
``Drop(patterns)`` / ``Keep(...)``      tensors the model does not use / only the tensors it does
``Substitute(pattern, replacement)``    a raw ``re.sub`` over every name (a model's ``CHECKPOINT_KEY_MAP``)
======================================  =============================================================================

Names are matched with *templates*: literal text with ``{placeholders}``. A template matches a whole name; a
placeholder matches any non-empty text (the shortest that fits) and the same placeholder in a target template
writes that text back, so ``Rename("cond_stage_model.transformer.{rest}", "{rest}")`` strips a prefix and
``Split("resblocks.{i}.attn.in_proj_weight", ("layers.{i}.q.weight", "layers.{i}.k.weight", "layers.{i}.v.weight"))``
splits every layer's fused projection. A rule whose sources match no tensor is an error unless ``optional=True``;
a rule that does not fit a tensor (a missing partner, a wrong shape) raises :class:`ConversionError` naming both.

Conversion is lazy and keeps the memory map: a view computes names and shapes only, and a tensor is read when
``get`` is indexed. Renames, transposes and split pieces of a file's tensor are NumPy views of its memmap; a
concatenation is a :class:`LazyTensor` that reads, for each slice it is asked for (one device's shard), only the
parts of its pieces inside that slice.

Each rule knows its inverse where it has one (:meth:`Rule.inverse`, :func:`inverse`), so ``convert_tensors(
state_dict(model), inverse(rules))`` writes a model back in the other format.
"""


from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._fused import Concat as Concat
from ._fused import Split as Split
from ._fused import Tie as Tie
from ._lazy import LazyTensor as LazyTensor
from ._lazy import TensorDict as TensorDict
from ._rules import Drop as Drop
from ._rules import Keep as Keep
from ._rules import Rename as Rename
from ._rules import Reshape as Reshape
from ._rules import Rule as Rule
from ._rules import Substitute as Substitute
from ._rules import SwapHalves as SwapHalves
from ._rules import Transpose as Transpose
from ._view import Dim as Dim

# -- the converter ----------------------------------------------------------------------------------------------------


def _check_rules(rules) -> tuple[Rule, ...]:
    if isinstance(rules, Rule):
        return (rules,)
    rules = tuple(rules)
    for r in rules:
        if not isinstance(r, Rule):
            raise TypeError(f"a conversion is a sequence of rules (Rename, Split, ...); got {r!r}")
    return rules


def convert(view, rules: Rule | Sequence[Rule], *, where: str = "checkpoint"):
    """``view`` (anything with ``names/shape/dtype/get``: a :class:`~eqxdiff.loading.SafetensorsFile`,
    :class:`~eqxdiff.loading.CheckpointFiles`, :class:`TensorDict`) seen through ``rules`` in turn. Names and shapes
    are worked out now (so a rule that does not fit fails here, naming the rule and the tensor); tensors are read
    when asked for."""
    for rule in _check_rules(rules):
        view = rule.apply(view, where)
    return view


def inverse(rules: Rule | Sequence[Rule]) -> tuple[Rule, ...]:
    """The rules that undo ``rules`` (in reverse order): from eqxdiff's names back to the other format."""
    return tuple(undo for rule in reversed(_check_rules(rules)) for undo in rule.inverse())


def convert_tensors(tensors: Mapping[str, Any], rules: Rule | Sequence[Rule], *,
                    where: str = "state dict") -> dict[str, np.ndarray]:
    """``{name: array}`` through ``rules``, read into NumPy arrays (``write_safetensors`` writes them)."""
    view = convert(TensorDict(tensors), rules, where=where)
    return {n: np.require(np.asarray(view.get(n)), requirements="C") for n in view.names()}  # 0-d stays 0-d
