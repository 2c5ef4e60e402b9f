"""One model's checkpoint in a family's original names, read by ``eqxdiff.load`` without ``conversion=``: the
families' single-file layouts (:data:`eqxdiff.core.SINGLE_FILE_LAYOUTS`) already say how each model they hold is
named in such files (a :class:`~eqxdiff.loading.single_file.Part`'s rules), so a lone file (or a folder of shards)
that holds every tensor of one of those parts is read through its rules: no second table of formats.
"""

from collections.abc import Sequence

from ..core import resolve_class, single_file_layouts
from ._convert import Rule
from ._errors import CheckpointError, ConversionError
from ._layout import check_tensors, layout_shapes


def part_rules(view, abstract, config, model_cls: type, *, where: str = "the checkpoint") -> Sequence[Rule]:
    """The conversion rules that read ``abstract`` (a ``model_cls`` built from ``config``) from ``view`` (the
    checkpoint's ``names()/shape()``): ``()`` if the checkpoint holds the model's own names, else the rules of the
    single-file part for ``model_cls`` under which it holds the most of the tensors the model needs (every one, for
    a whole file: a file missing some is then reported in its own layout); ``()`` if no part fits better than the
    model's own names. A file that holds most but not all of a part's tensors, or some in other shapes (a config of
    another size), is a :class:`CheckpointError` naming, in the file's names, those it lacks or holds in other
    shapes (not a rule that matched nothing, nor the model's names). A checkpoint that fits no part and is a
    whole file of a layout without a ``model_cls`` (another family's file, ``where``) is a :class:`CheckpointError`
    saying what it holds."""
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
    if best < 1.0:
        _check_family(view, model_cls, where)
    if best_rules:  # the part it fits best, less some tensors or some of other shapes: named in the file's own names
        check_tensors(view, abstract, best_rules, where=where, what=f"the {model_cls.__name__}",
                      hint="The file is incomplete or holds another model: download it again, or pass config= "
                           "the config of the model it holds")
    return best_rules


def _check_family(view, model_cls: type, where: str) -> None:
    """Raise a :class:`CheckpointError` if ``view`` is in a single-file layout of which no model is a
    ``model_cls`` (a Wan transformer file given an LTX-Video config)."""
    matching = [layout for layout in single_file_layouts() if layout.matches(view)]
    if not matching or any(resolve_class(p.model_class) is model_cls for lay in matching for p in lay.parts):
        return
    layout = matching[0]
    holds = " and ".join(f"the {p.name} ({p.model_class})" for p in layout.parts if p.held(view))
    raise CheckpointError(
        f"{where} is a {layout.family} file (the {layout.name!r} layout, holding {holds}), not a "
        f"{model_cls.__name__} as the config passed says; pass config= the config of the model it holds (a diffusers "
        f"{layout.family} folder's, e.g. {layout.hub_id!r}), or load the pipeline with "
        "eqxdiff.load_pipeline(file, config=...)")


__all__ = ["part_rules"]
