"""Single-file layouts as data: what a whole-pipeline ``.safetensors`` file holds, and how to read each model in it.

A :class:`Layout` is declared by a family (Stable Diffusion's in :mod:`eqxdiff.loading.single_file`, Flux's in its
pipeline module) and listed in :data:`eqxdiff.core.SINGLE_FILE_LAYOUTS`; one shared assembly
(``eqxdiff.pipelines._single_file``) reads every layout. A layout names the tensors that tell a file in it
(``signature``), the pipeline classes it loads as, and its models (:class:`Part`): each a prefix, conversion rules in
the loader's vocabulary (:mod:`eqxdiff.loading._convert`) and, where the tensors show it, the model's config. What
the file lacks (tokenizers, a scheduler, models it does not hold, configs its tensors do not show) comes from
``config=``, a diffusers folder or Hub id, or from the layout's published values.
"""

import dataclasses
import re
from collections.abc import Mapping

import numpy as np

from ..core import leaf_specs
from ._convert import Rule, convert, convert_tensors, inverse
from ._errors import CheckpointError
from ._fill import state_dict
from ._rules import select


@dataclasses.dataclass(frozen=True, kw_only=True)
class Part:
    """One model a single file holds: the pipeline component ``name`` it becomes, the checkpoint class
    ``model_class`` it loads as, and the ``prefix`` its tensors are stored under. This base reads a model stored in
    its library's own names (ComfyUI's T5) and takes its config from ``config=``; subclasses read other layouts
    (:meth:`rules`) and read configs from the tensors (:meth:`infer`). ``optional``: files in the layout may lack
    it (the pipeline then takes it from ``config=``). ``infer_config=False``: its config comes from ``config=``
    only, even where the tensors would show it (values a layout does not publish)."""

    name: str
    model_class: str
    prefix: str
    optional: bool = False
    infer_config: bool = True

    @property
    def needs(self) -> tuple[str, ...]:
        """The parts whose configs :meth:`infer` reads (declared before this one in the layout)."""
        return ()

    def held(self, view) -> bool:
        """Whether the file (``view``) holds this model."""
        return any(n.startswith(self.prefix) for n in view.names())

    def rules(self, config, view=None) -> tuple[Rule, ...]:
        """The conversion of this model (built from ``config``) from the file's names to eqxdiff's; ``view``: the
        file, when reading it. Inverted, it writes the model in the file's layout."""
        return select(self.prefix)

    def infer(self, view, *, where: str, configs: Mapping) -> dict | None:
        """This model's ``config.json`` (a dict) read from the file's tensors and the layout's published values;
        ``configs``: the configs of the parts before it, by name. ``None``: only ``config=`` gives it."""
        return None

    def fits(self, config) -> bool:
        """Whether a model of ``config`` is what this part holds (which layout writes a pipeline)."""
        return True

    def extra_tensors(self, config, written: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Tensors a file in this layout holds beside the model's own (written with it, dropped when reading);
        ``written``: the model's tensors in the file's names, for entries derived from them."""
        return {}


@dataclasses.dataclass(frozen=True)
class Sized:
    """A signature entry: the file holds tensor ``name`` with ``size`` along ``axis`` (an inpainting UNet's 9 input
    channels)."""

    name: str
    axis: int
    size: int

    def __str__(self) -> str:
        return f"{self.name} of {self.size} along axis {self.axis}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """A single-file layout (see the module docstring).

    ``name``: how eqxdiff calls it (``"sdxl"``); ``family``: the family's name in messages (``"Flux"``).
    ``pipelines``: the pipeline classes (family-table names) a file loads as: the first, unless ``config=``'s
    ``model_index.json`` names another of them. ``signature``: what tells a file in this layout: name prefixes
    that some tensor starts with, and :class:`Sized` entries. ``parts``: its models, in the order their configs
    are worked out. ``tokenizers``: each tokenizer component and the model it serves (loaded with it).
    ``hub_id``: the family's Hub repository: without ``config=`` the tokenizers are fetched from it; the example in
    messages. ``scheduler``: the ``scheduler_config.json`` without ``config=``; ``None``: ``config=`` must be given.
    ``options``: the pipeline's ``model_index.json`` options without ``config=``."""

    name: str
    family: str
    pipelines: tuple[str, ...]
    signature: tuple[str | Sized, ...]
    parts: tuple[Part, ...]
    tokenizers: Mapping[str, str]
    hub_id: str
    scheduler: Mapping | None = None
    options: Mapping = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        seen: set[str] = set()
        for part in self.parts:
            late = sorted(set(part.needs) - seen)
            if late:
                raise ValueError(f"layout {self.name!r}: the {part.name} needs {late}, which are not parts declared "
                                 "before it")
            seen.add(part.name)
        if not self.pipelines or not self.signature:
            raise ValueError(f"layout {self.name!r}: give its pipelines and its signature")

    @property
    def needs_config(self) -> bool:
        """Whether a file in this layout loads only with ``config=``."""
        return self.scheduler is None

    def matches(self, view) -> bool:
        """Whether the file ``view`` is in this layout (holds its signature)."""
        names = view.names()
        for entry in self.signature:
            if isinstance(entry, Sized):
                shape = tuple(view.shape(entry.name)) if entry.name in names else ()
                if not -len(shape) <= entry.axis < len(shape) or shape[entry.axis] != entry.size:
                    return False
            elif not any(n.startswith(entry) for n in names):
                return False
        return True

    def check_complete(self, view, where: str) -> None:
        """Raise a :class:`CheckpointError` naming a model the file (in this layout) must hold and lacks."""
        for part in self.parts:
            if not part.optional and not part.held(view):
                raise CheckpointError(f"{where} looks like a {self.name} file but holds no {part.name} (no tensor "
                                      f"under {part.prefix!r}); the file is incomplete: download it again, or load "
                                      "its models one by one with eqxdiff.load(file, ..., conversion=...)")


def detect(view, where: str, layouts) -> Layout:
    """The first of ``layouts`` that the file ``view`` is in, checked complete; else a :class:`CheckpointError`
    saying what the file holds and what eqxdiff knows, or, for a file that holds some of a layout's signature
    (:func:`_nearest`: a Wan transformer without its ``head.modulation``), which layout and what it lacks."""
    for layout in layouts:
        if layout.matches(view):
            layout.check_complete(view, where)
            return layout
    names = view.names()
    near = _nearest(names, layouts)
    if near is not None:
        layout, held, lacks = near
        raise CheckpointError(
            f"{where} is almost a {layout.family} file (the {layout.name!r} layout): it holds {short(held)} but lacks "
            f"{short(lacks)}, so the file is incomplete or damaged; download it again (eqxdiff.load(file, config=...) "
            "with its model's config names every tensor it lacks)")
    known = list(dict.fromkeys(p.prefix for layout in layouts for p in layout.parts if p.prefix))
    found = [p for p in known if any(n.startswith(p) for n in names)]
    if not found:
        raise CheckpointError(
            f"{where} is not in a single-file layout eqxdiff knows: no tensor name starts with any of "
            f"{', '.join(repr(p) for p in known)} (it holds {short(sorted(names), 4) or 'no tensor'}). A file of one "
            "model in diffusers' names loads with eqxdiff.load(file, model_class=..., config=...); other formats with "
            "conversion rules (eqxdiff.loading.formats)")
    told = {}  # what tells each layout (its variants, told apart by tensor sizes, under their plain name)
    for layout in layouts:
        told[" and ".join(repr(e) for e in layout.signature if isinstance(e, str))] = layout.name
    signatures = "; ".join(f"{name}: {names}" for names, name in told.items())
    raise CheckpointError(
        f"{where} holds tensors under {', '.join(repr(p) for p in found)} but not a whole pipeline in a layout "
        f"eqxdiff knows (what tells each: {signatures}). A model alone in such a file loads with "
        "eqxdiff.load(file, model_class=..., config=..., conversion=part.rules(config)), part the one of its prefix "
        "in a layout of eqxdiff.core.single_file_layouts()")


def _nearest(names, layouts):
    """``(layout, held, lacking)``: the layout whose signature the file holds all but the fewest names of (a family's
    plain layout before its releases' variants), at least one held a whole tensor's name (not a prefix that other
    families' files share, such as ``vae.decoder.``); ``None`` if there is none."""
    best, best_rank = None, (0, 0)
    for layout in layouts:
        entries = [e for e in layout.signature if isinstance(e, str)]
        held = [e for e in entries if any(n.startswith(e) for n in names)]
        lacks = [e for e in entries if e not in held]
        rank = (-len(lacks), -len(layout.signature))  # fewest lacking; a release's variant after its family's
        if lacks and any(not e.endswith(".") for e in held) and (best is None or rank > best_rank):
            best, best_rank = (layout, held, lacks), rank
    return best


# -- checking a file against a model, and writing a model in the layout ----------------------------------------------


class Shapes:
    """The names and shapes of a model's tensors, no values: what :func:`convert` needs to work out a layout."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]):
        self._shapes = dict(shapes)

    def names(self):
        return list(self._shapes)

    def shape(self, name):
        return self._shapes[name]

    def dtype(self, name):
        return np.dtype(np.float32)

    def get(self, name):
        raise CheckpointError(f"{name!r}: only the shapes of this model are known here")


def layout_shapes(abstract, rules) -> dict[str, tuple[int, ...]]:
    """The names and shapes ``abstract`` (a module, abstract or not) has in the layout ``rules`` read."""
    leaves, specs, _ = leaf_specs(abstract)
    shapes = {n: spec.torch_shape(leaf.shape) for leaf, spec in zip(leaves, specs) for n in spec.names}
    view = convert(Shapes(shapes), inverse(rules), where="model")
    return {n: tuple(view.shape(n)) for n in view.names()}


def check_tensors(view, abstract, rules, *, where: str, what: str, hint: str) -> None:
    """Raise a :class:`CheckpointError` naming, in the file's own names, every tensor ``abstract`` needs that the
    file (``view``) lacks or holds in another shape."""
    expected = layout_shapes(abstract, rules)
    held = set(view.names())
    missing = sorted(n for n in expected if n not in held)
    wrong = [f"{n!r} is {tuple(view.shape(n))}, the config gives {s}" for n, s in expected.items()
             if n in held and tuple(view.shape(n)) != s]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {short(missing)}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) of another shape: {short(wrong, 4, quote=False)}")
    if problems:
        raise CheckpointError(f"{what} in {where}: {'; '.join(problems)}. {hint}")


def layout_tensors(model, rules) -> dict[str, np.ndarray]:
    """``model``'s parameters in the layout ``rules`` read (their inverse), as NumPy arrays."""
    return convert_tensors(state_dict(model), inverse(rules), where=f"{type(model).__name__} state dict")


# -- helpers for the parts' config inference --------------------------------------------------------------------------


class Stored:
    """The names and shapes under ``prefix`` in a file, the prefix removed."""

    def __init__(self, view, prefix: str):
        self.prefix = prefix
        self.shapes = {n[len(prefix):]: tuple(view.shape(n)) for n in view.names() if n.startswith(prefix)}
        self.names = list(self.shapes)

    def has(self, name: str) -> bool:
        return name in self.shapes

    def shape(self, name: str, where: str, what: str | None = None) -> tuple[int, ...]:
        if name not in self.shapes:
            about = f" ({what})" if what else ""
            raise CheckpointError(f"{where} lacks tensor {self.prefix + name!r}{about}; the file is incomplete or "
                                  "not in this layout: download it again, or pass config= and load its models one "
                                  "by one with eqxdiff.load(file, ..., conversion=...)")
        return self.shapes[name]

    def indices(self, head: str) -> list[int]:
        """The sorted ``i`` of every ``head.{i}.`` name."""
        pattern = re.compile(re.escape(head) + r"\.(\d+)\.")
        return sorted({int(m.group(1)) for n in self.names if (m := pattern.match(n))})

    def count(self, head: str) -> int:
        return len(self.indices(head))


def cannot_infer(where: str, why: str) -> CheckpointError:
    return CheckpointError(f"cannot infer the config of {where}: {why}. Pass config= a diffusers folder or Hub id "
                           "of this model (its model_index.json and component config.json files)")


def heads(width: int, head_width: int = 64) -> int:
    """``width // head_width`` heads if that divides ``width``, else one."""
    n = width // head_width
    return n if n and width % n == 0 else 1


def short(items, limit: int = 6, quote: bool = True) -> str:
    items = list(items)
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(repr(i) if quote else str(i) for i in items[:limit]) + more
