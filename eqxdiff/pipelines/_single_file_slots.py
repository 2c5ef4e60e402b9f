"""Which pipeline component each single file fills: ``load_pipeline({"transformer": high, "transformer_2": low},
config=folder)`` names them; a lone file fills the components its layout names, and says so where ``config=``'s
folder lists another component of the same class (two experts of one architecture, as Wan 2.2 A14B's: a file cannot
tell which of them it is)."""

import dataclasses
import os
import warnings
from collections.abc import Mapping

from ..loading import CheckpointError
from ..loading.single_file import Layout, Part
from ._checks import InputWarning

__all__ = ["assign_parts", "file_component_problem", "file_targets", "warn_same_class"]


def file_targets(path) -> list[tuple[str | None, object]]:
    """``[(component or None, file)]``: a mapping ``{component: file}`` checked for its form, or one file (whose
    layout says what it fills: ``None``)."""
    if not isinstance(path, Mapping):
        return [(None, path)]
    if not path or not all(isinstance(k, str) for k in path):
        raise CheckpointError(f"load_pipeline({path!r}): a mapping of single files is {{component name: .safetensors "
                              "file}}, e.g. {'transformer': 'high_noise.safetensors', 'transformer_2': "
                              "'low_noise.safetensors'}, with config= the diffusers folder of the rest")
    return list(path.items())


def _listed(index: Mapping, name: str) -> list | None:
    entry = index.get(name)
    return entry if isinstance(entry, list) and entry and entry[0] is not None else None


def file_component_problem(cls, target: str, index: Mapping, config, *, flags: bool = False) -> str | None:
    """Why a file cannot fill the component ``target`` of ``cls`` by its name alone, or None: ``cls`` has no such
    model component, or ``config``'s ``model_index.json`` (``index``; empty: not read) lists none. ``flags``: said
    in ``eqxdiff-generate``'s words (``--component``, ``--config``), checked before loading; else
    ``load_pipeline``'s."""
    call = f"--component {target}=FILE" if flags else f"load_pipeline({{{target!r}: file}})"
    given = f"--config {os.fspath(config)!r}" if flags else f"config={os.fspath(config)!r}"
    models = [c.name for c in cls.COMPONENTS if c.kind == "model"]
    if target not in models:
        return f"{call}: a {cls.__name__} has no model component {target!r}; name one of {models}"
    if index and _listed(index, target) is None:
        return (f"{call}: {given} lists no {target} (model_index.json), so its pipeline would not run one; pass "
                f"{'--config' if flags else 'config='} a folder of a pipeline with a {target}, or map the file to "
                "another component")
    return None


def assign_parts(cls, target: str, parts: list[Part], layout: Layout, index: Mapping, config, where: str) -> Part:
    """The one model a file in the mapping holds (``parts``), as the component ``target`` of ``cls`` it fills:
    refused if ``cls`` has no such model component, the file holds several models or one of another class, or
    ``config=`` (its ``model_index.json``: ``index``) lists no ``target``."""
    problem = file_component_problem(cls, target, index, config)
    if problem is not None:
        raise CheckpointError(problem)
    models = {c.name: c for c in cls.COMPONENTS if c.kind == "model"}
    if len(parts) != 1:
        raise CheckpointError(f"{where} holds {len(parts)} models ({', '.join(p.name for p in parts)}), and a file "
                              f"in load_pipeline's mapping fills one component ({target!r}); pass this file alone: "
                              "eqxdiff.load_pipeline(file, config=...)")
    part, classes = parts[0], models[target].classes
    if classes and part.model_class not in classes:
        fits = [n for n, c in models.items() if not c.classes or part.model_class in c.classes]
        raise CheckpointError(f"{where} holds a {part.model_class} (a {layout.family} {part.name}), which cannot be "
                              f"the {target} of a {cls.__name__} (a {' or '.join(classes)}); map the file to "
                              f"{' or '.join(map(repr, fits)) or 'another pipeline'}")
    return dataclasses.replace(part, name=target)


def warn_same_class(cls, held: list[Part], index: Mapping, config, path) -> None:
    """An :class:`InputWarning` for each model a lone file fills where ``config=``'s ``model_index.json``
    (``index``) lists other components of its class that the file does not fill: they come from the folder, and
    the file may be one of them."""
    filled = {part.name for part in held}
    for part in held:
        twins = [c.name for c in cls.COMPONENTS if c.kind == "model" and c.name not in filled
                 and (_listed(index, c.name) or [None, None])[1] == part.model_class]
        if twins:
            file = os.fspath(path)
            warnings.warn(
                f"file {file!r} holds one {part.model_class}, read as the {part.name}; config={os.fspath(config)!r} "
                f"lists {' and '.join(twins)} of the same class, read from it. A file cannot tell which it is: if it "
                f"is the {twins[0]}, say so with eqxdiff.load_pipeline({{{twins[0]!r}: {file!r}}}, config=...), or "
                f"give both files: {{{part.name!r}: ..., {twins[0]!r}: ...}}", InputWarning, stacklevel=4)
