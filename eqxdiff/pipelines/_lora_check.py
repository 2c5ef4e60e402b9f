"""Whether a LoRA file fits a pipeline, as one check that loading and the command line share.

:func:`check_coverage` is the refusal ``load_lora_weights`` makes once a file's modules are matched (another
family, nothing that applies, keys that adapt nothing); :func:`check_lora_file` runs it (and the rank check of
``max_rank``) on a pipeline *class* and its models, which may be abstract (``eqx.filter_eval_shape``: no weight
read), so that ``eqxdiff-generate`` refuses a file before it loads the pipeline.
"""

import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from .. import nn
from ..loading import CheckpointError
from ..loading.lora import LoraFile, Matcher, match_models, parse, read_lora, site_adapters
from ._lora_format import LoraFormat, detect_family, load_format

MAX_LISTED = 10  # keys listed in an error before "and N more"


class LoraWarning(UserWarning):
    """A LoRA file loaded with ``strict=False`` holds keys that adapt nothing in this pipeline."""


def listed(keys: Sequence[str]) -> str:
    keys = list(keys)
    more = f" ... and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else ""
    return ", ".join(repr(k) for k in keys[:MAX_LISTED]) + more


def lora_format(cls: type) -> LoraFormat:
    """Pipeline class ``cls``'s :class:`LoraFormat`; a class that declares none is refused."""
    fmt = load_format(getattr(cls, "LORA_FORMAT", None))
    if fmt is None:
        raise ValueError(f"{cls.__name__} declares no LoRA format (LORA_FORMAT): its family does not read LoRA files "
                         "yet")
    return fmt


def other_family(fmt: LoraFormat, path: str, tensors: Mapping) -> None:
    """Refuse a file most of whose keys look like another family's (by the families' markers)."""
    family, evidence = detect_family(tensors)
    if family is not None and family != fmt.family and len(evidence) >= len(tensors) // 2:
        raise CheckpointError(f"{path!r} is a LoRA for {family} (keys such as {evidence[0]!r}), not for "
                              f"{fmt.family}; load it into a {family} pipeline")


def check_coverage(fmt: LoraFormat, pipeline: str, components: Sequence[str], path: str, tensors: Mapping, matched,
                   unmatched, unknown, strict: bool, *, stacklevel: int = 4) -> None:
    """Refuse a file for another family, a file of which nothing applies and (``strict``) any key that adapts
    nothing in ``pipeline`` (a class name; ``components``: its models); warn once otherwise."""
    left = [k for rec in unmatched for k in rec.keys] + list(unknown)
    if not left:
        return
    other_family(fmt, path, tensors)
    what = (f"{len(left)} of the {len(tensors)} tensors of {path!r} adapt nothing in this {pipeline} "
            f"({', '.join(components)}): {listed(sorted(left))}")
    if not matched:
        raise CheckpointError(f"{what}. Nothing in the file applies: it is not a LoRA for {fmt.family} (or a "
                              "layout eqxdiff does not read); eqxdiff.lora.inspect(file) reports what it holds")
    if strict:
        raise CheckpointError(f"{what}. Check the file is for this model; strict=False loads the rest with a "
                              "warning")
    warnings.warn(f"{what}; loading the rest (strict=False)", LoraWarning, stacklevel=stacklevel)


def check_lora_file(cls: type, path_or_hub_id, models: Mapping[str, object] | None = None, *,
                    weight_name: str | None = None, revision: str | None = None, strict: bool = True,
                    max_rank: int | None = None) -> LoraFile:
    """What ``cls.load_lora_weights`` would refuse in the file, found before anything is loaded: ``models``
    (component -> model of a ``cls`` pipeline, abstract ones too) give the full check (``strict``; and, with
    ``max_rank``, the ranks the adapters get); without them only the family the keys say. Returns the file read
    (tensors memory-mapped)."""
    fmt = lora_format(cls)
    file = read_lora(path_or_hub_id, weight_name=weight_name, revision=revision)
    records, unknown = parse(file.tensors)
    models = {k: v for k, v in (models or {}).items() if v is not None}
    if not models:
        other_family(fmt, file.path, file.tensors)
        return file
    matched, unmatched, widened = match_models(lambda m: Matcher(m, fmt.namings, fmt.layouts), models, records)
    models = {**models, **widened}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LoraWarning)  # loading warns; the check before it need not
        check_coverage(fmt, cls.__name__, list(models), file.path, file.tensors, matched, unmatched, unknown, strict)
    if max_rank is not None:
        dtypes = {site: np.dtype(nn.resolve_site(model, site).weight.dtype) for model in models.values()
                  for site in nn.adapter_sites(model)}
        try:
            site_adapters(matched, file.peft_config(), dtypes.__getitem__, max_rank=max_rank)
        except ValueError as e:
            raise CheckpointError(f"{file.path!r}: {e}") from None
    return file


def peft_order(model, slots: dict, active: Sequence[str]):
    """PEFT composes a layer's adapters in the active order (a DoRA entry's factor multiplies the layer's output so
    far): the entries of ``model``'s sites that hold a PEFT DoRA entry put in ``active``'s order (the others after,
    as held), ``slots`` (site -> names, as the entries) reordered with them in place. A new order is a new structure
    (it compiles once); sites without DoRA keep theirs (the order does not matter there)."""
    rank, changes = {n: i for i, n in enumerate(active)}, {}
    for path, held in slots.items():
        adapters = nn.resolve_site(model, path).adapters
        if adapters is None or not any(isinstance(a, nn.DoRA) and a.mode == "peft" for a in adapters.entries):
            continue
        perm = sorted(range(len(held)), key=lambda i: (rank.get(held[i], len(active)), i))
        if perm != list(range(len(held))):
            changes[path], slots[path] = nn.entries_kept(adapters, perm), [held[i] for i in perm]
    return nn.with_adapters(model, changes) if changes else model


__all__ = ["LoraWarning", "check_coverage", "check_lora_file", "listed", "lora_format",
           "other_family", "peft_order"]
