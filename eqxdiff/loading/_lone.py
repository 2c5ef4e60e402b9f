"""One model's checkpoint in a family's original names, read by ``eqxdiff.load`` without ``conversion=``: the
families' single-file layouts (:data:`eqxdiff.core.SINGLE_FILE_LAYOUTS`) already say how each model they hold is
named in such files (a :class:`~eqxdiff.loading.single_file.Part`'s rules), so a lone file (or a folder of shards)
that holds every tensor of one of those parts is read through its rules: no second table of formats.
"""

from collections.abc import Sequence

from ..core import resolve_class, single_file_layouts
from ._convert import Rule
from ._errors import ConversionError
from ._layout import layout_shapes


def part_rules(view, abstract, config, model_cls: type) -> Sequence[Rule]:
    """The conversion rules that read ``abstract`` (a ``model_cls`` built from ``config``) from ``view`` (the
    checkpoint's ``names()/shape()``): ``()`` if the checkpoint holds the model's own names, else the rules of the
    single-file part for ``model_cls`` under which it holds the most of the tensors the model needs (every one, for
    a whole file: a file missing some is then reported in its own layout); ``()`` if no part fits better than the
    model's own names."""
    names = set(view.names())

    def held(expected) -> float:
        return len(names & set(expected)) / max(len(expected), 1)

    best, best_rules = held(layout_shapes(abstract, ())), ()
    if best == 1.0:
        return ()
    for layout in single_file_layouts():
        for part in layout.parts:
            if resolve_class(part.model_class) is not model_cls:
                continue
            try:
                rules = part.rules(config, view)
                share = held(layout_shapes(abstract, rules))
            except ConversionError:
                continue
            if share > best:
                best, best_rules = share, rules
    return best_rules


__all__ = ["part_rules"]
