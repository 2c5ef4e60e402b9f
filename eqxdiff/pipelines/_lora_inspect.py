"""``eqxdiff.lora`` (``eqxdiff.pipelines.lora``): what a LoRA file is, and whether a pipeline can use it.

>>> import eqxdiff
>>> print(eqxdiff.lora.inspect("pixel-art-xl.safetensors"))
>>> print(eqxdiff.lora.inspect("pixel-art-xl.safetensors", pipe))   # + what adapts this pipeline, and what not

:func:`inspect` reads only the file's header and small tensors (nothing is built or compiled): its formats (the
trainers' key styles and namings), the family it is for, the modules it targets, ranks, alphas and adapter types.
Loading is the pipelines' ``load_lora_weights`` (:mod:`eqxdiff.pipelines._lora`).
"""

import collections
import dataclasses
import re
from collections.abc import Mapping

from ..loading.lora import Matcher, Record, match_models, parse, read_lora
from ._lora import LoadedAdapter, LoraWarning
from ._lora_format import LoraFormat, all_formats, detect_family, load_format

__all__ = ["LoadedAdapter", "LoraReport", "LoraWarning", "adapter_type", "inspect"]


def adapter_type(rec: Record) -> str:
    """``"LoRA"``, ``"LoCon"`` (a convolution), ``"LoCon (Tucker)"``, ``"LoHa"``, ``"LoKr"``, ``"full diff"``,
    ``"replaced parameter"`` (a norm's new scale);
    ``" + DoRA"`` with a magnitude."""
    t = rec.tensors
    if rec.kind == "lora":
        name = "LoCon (Tucker)" if "mid" in t else "LoCon" if t["down"].ndim > 2 else "LoRA"
    else:
        name = {"loha": "LoHa", "lokr": "LoKr", "diff": "full diff", "replace": "replaced parameter"}[rec.kind]
    return name + (" + DoRA" if rec.magnitude is not None else "")


def _rank(rec: Record) -> int | str:
    t = rec.tensors
    if rec.kind == "lora":
        return int(t["down"].shape[0])
    if rec.kind == "loha":
        return int(t["w1b"].shape[0])
    if rec.kind == "lokr":
        low = t.get("w2b", t.get("w1b"))
        return "full" if low is None else int(low.shape[0])
    return "full"


def _module_type(key: str) -> str:
    """The layer kind a module key ends in (``attn1.to_q``, ``img_attn.qkv``, ``ff.net.0.proj``)."""
    return re.split(r"[._]\d+[._]", key)[-1]


@dataclasses.dataclass
class LoraReport:
    """What :func:`inspect` found. Counts are of the file's modules (one per adapted layer)."""

    path: str
    family: str | None
    formats: dict[str, int]
    adapter_types: dict[str, int]
    ranks: dict
    alphas: dict
    target_modules: dict[str, int]
    components: dict[str, int]
    modules: int
    unknown_keys: list[str]
    metadata: Mapping
    pipeline: str | None = None
    matched: list[str] | None = None
    unmatched: list[str] | None = None

    @property
    def supported(self) -> bool | None:
        """With a pipeline: whether every module of the file adapts a layer of it (``None`` without one)."""
        if self.matched is None:
            return None
        return bool(self.matched) and not self.unmatched and not self.unknown_keys

    def __str__(self) -> str:
        def counts(d):
            return ", ".join(f"{k} x{v}" if v != 1 else str(k) for k, v in d.items()) or "-"

        lines = [f"LoRA file {self.path}",
                 f"  family:         {self.family or 'not recognised'}",
                 f"  format:         {counts(self.formats)}",
                 f"  adapter types:  {counts(self.adapter_types)}",
                 f"  ranks:          {counts(self.ranks)}",
                 f"  alphas:         {counts(self.alphas)}",
                 f"  components:     {counts(self.components)}",
                 f"  target modules: {counts(self.target_modules)}",
                 f"  modules:        {self.modules}"]
        if self.unknown_keys:
            lines.append(f"  unknown keys:   {len(self.unknown_keys)} (e.g. {self.unknown_keys[0]!r})")
        if self.matched is not None:
            verdict = "yes, every module" if self.supported else "partly" if self.matched else "no"
            lines.append(f"  {self.pipeline}: {verdict} ({len(self.matched)} of {self.modules} modules adapt it)")
            lines += [f"    not matched: {k}" for k in self.unmatched[:10]]
            if len(self.unmatched) > 10:
                lines.append(f"    ... and {len(self.unmatched) - 10} more")
        return "\n".join(lines)


def _naming_of(fmt: LoraFormat | None, key: str):
    if fmt is None:
        return None
    return next((n for n in sorted(fmt.namings, key=lambda n: -len(n.prefix)) if key.startswith(n.prefix)), None)


def inspect(path_or_hub_id, pipeline=None, *, weight_name: str | None = None, revision: str | None = None,
            models: Mapping[str, object] | None = None) -> LoraReport:
    """Report what a LoRA file is (see the module docstring); with ``pipeline`` (an eqxdiff pipeline), also which
    of its modules adapt that pipeline's models and which do not (``report.supported``). ``pipeline`` may be a
    pipeline class with ``models`` (component -> model; abstract ones, ``eqx.filter_eval_shape``'s, do: no weight is
    read), as ``eqxdiff-generate --lora-info FILE --model FOLDER`` asks before loading anything."""
    file = read_lora(path_or_hub_id, weight_name=weight_name, revision=revision)
    records, unknown = parse(file.tensors)
    family, _ = detect_family(file.tensors)
    formats = {f.family: f for f in all_formats()}
    fmt = formats.get(family)
    matched = unmatched = None
    name, namings = None, {}
    if pipeline is not None:
        cls = pipeline if isinstance(pipeline, type) else type(pipeline)
        own = load_format(getattr(cls, "LORA_FORMAT", None))
        name = cls.__name__
        if models is None and isinstance(pipeline, type):
            raise TypeError(f"inspect(file, {name}): a pipeline class needs models= (component -> model)")
        if own is not None:
            models = pipeline._lora_models() if models is None else models
            found, missed, _ = match_models(lambda m: Matcher(m, own.namings, own.layouts), models, records)
            matched, unmatched = [m.record.key for m in found], [r.key for r in missed]
            if found and not missed:
                family, fmt = own.family, own
            namings = {m.record.key: m.naming for m in found}
        else:
            matched, unmatched = [], [r.key for r in records]
    styles, components = collections.Counter(), collections.Counter()
    for rec in records:
        naming = namings.get(rec.key) if namings else _naming_of(fmt, rec.key)
        label = naming.label if naming is not None else None
        styles[f"{rec.style}" + (f", {label} names" if label and label != rec.style else "")] += 1
        if naming is not None:
            components[naming.component] += 1
    return LoraReport(
        path=file.path, family=family, formats=dict(styles),
        adapter_types=dict(collections.Counter(adapter_type(r) for r in records)),
        ranks=dict(sorted(collections.Counter(_rank(r) for r in records).items(), key=lambda kv: str(kv[0]))),
        alphas=dict(collections.Counter(r.alpha for r in records)),
        target_modules=dict(collections.Counter(_module_type(r.key) for r in records).most_common()),
        components=dict(components), modules=len(records), unknown_keys=list(unknown),
        metadata=file.peft_config(), pipeline=name, matched=matched, unmatched=unmatched)
