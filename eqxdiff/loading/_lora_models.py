"""What a LoRA file changes in a model beyond adapters: a projection widened to more inputs, and parameters a file
replaces whole (Black Forest Labs' control LoRAs do both: ``img_in`` takes the control image's latents beside the
noisy ones, and the q/k RMSNorms' scales are new values).

- :func:`widened_models`: a LoRA whose ``lora_A`` reads more input features than its Linear has widens that Linear
  with zero columns (the added inputs contribute nothing but the adapter's change, as diffusers'
  ``_maybe_expand_transformer_param_shape_or_error_`` does) and the model's config with it. Which inputs may widen
  is the model's declaration: ``with_input_width(config, layer, width)`` returns the config of the wider model (a
  Flux transformer's ``x_embedder`` is its ``in_channels``), or ``None``.
- :func:`replacements_as_differences`: a ``"replace"`` record (a parameter's whole new value) becomes a whole
  difference from the model's current value (a ``diff`` record), so that it sits in the layer's adapter slot like
  any adapter: switched and scaled with its file's adapter, removed by ``unload_lora_weights``. Only a norm's 1-D
  weight may be replaced this way; anything else stays unmatched (a full checkpoint is not a LoRA).
"""

from collections.abc import Mapping, Sequence

import equinox as eqx
import jax
import numpy as np

from .. import nn
from ..core import replace_static
from ._errors import CheckpointError
from ._lora_file import Record
from ._lora_match import Match


def _input_width(match: Match) -> int | None:
    """The input features the record's adapter reads, if it is a LoRA over a Linear."""
    down = match.record.tensors.get("down") if match.record.kind == "lora" else None
    return None if down is None or down.ndim != 2 else int(down.shape[1])


def widened_models(matches: Sequence[Match], models: Mapping[str, object]) -> dict[str, object]:
    """Component -> its model with the Linears the file's LoRAs read more inputs of widened (zero columns added,
    the config as the model declares); only the components that change. Raises ``CheckpointError`` for a layer the
    model does not declare widenable."""
    wanted: dict[str, dict[tuple, tuple[nn.Site, int]]] = {}
    for m in matches:
        width = _input_width(m)
        for run in m.runs:
            site = run.site
            if width is None or len(site.shape) != 2 or width <= site.shape[1]:
                continue
            where = f"{m.naming.component} layer {site.name!r}"
            if site.layers is not None:
                raise CheckpointError(f"{where}: the file's adapter reads {width} inputs, the layer {site.shape[1]}; "
                                      "a stacked layer cannot be widened")
            before = wanted.setdefault(m.naming.component, {}).get(site.path)
            if before is not None and before[1] != width:
                raise CheckpointError(f"{where}: the file's adapters read {before[1]} and {width} inputs")
            wanted[m.naming.component][site.path] = (site, width)
    out = {}
    for component, sites in wanted.items():
        model = models[component]
        config = model.config
        hook = getattr(type(model), "with_input_width", None)
        for path, (site, width) in sites.items():
            config = None if hook is None else hook(config, site.name, width)
            if config is None:
                raise CheckpointError(
                    f"{component} layer {site.name!r} takes {site.shape[1]} inputs but the file's adapter reads "
                    f"{width}: {type(model).__name__} does not declare that input widenable (a control LoRA for "
                    "another model?); use a file made for this model")
            old = nn.resolve_site(model, path).weight
            if isinstance(old, jax.ShapeDtypeStruct):  # an abstract model (a check before loading)
                weight = jax.ShapeDtypeStruct((site.shape[0], width), old.dtype)
            else:
                weight = np.zeros((site.shape[0], width), np.dtype(old.dtype))
                weight[:, :site.shape[1]] = np.asarray(old)
                weight = nn.place_like(weight, old)
            model = eqx.tree_at(lambda mod, path=path: nn.resolve_site(mod, path).weight, model, weight)
        out[component] = replace_static(model, config=config)
    return out


def replacements_as_differences(matches: Sequence[Match], models: Mapping[str, object]
                                ) -> tuple[list[Match], list[Record]]:
    """``(matches, unmatched)``: each ``"replace"`` record of a norm's 1-D weight as a ``diff`` record (its new value
    minus the model's, float32); a ``"replace"`` record of anything else unmatched."""
    kept, unmatched = [], []
    for m in matches:
        rec = m.record
        if rec.kind != "replace":
            kept.append(m)
            continue
        run = m.runs[0] if len(m.runs) == 1 else None
        site = None if run is None else run.site
        new = np.asarray(rec.tensors["weight"], np.float32)
        if site is None or len(site.shape) != 1 or new.shape != site.shape or run.start or run.row:
            unmatched.append(rec)
            continue
        weight = nn.resolve_site(models[m.naming.component], site).weight
        if isinstance(weight, jax.ShapeDtypeStruct):  # an abstract model: the difference's shape is what counts
            current = np.zeros_like(new)
        else:
            current = np.asarray(weight, np.float32)
            current = current if run.layer is None else current[run.layer]
        diff = Record(rec.key, "diff", {"diff": new - current}, style=rec.style, keys=list(rec.keys))
        kept.append(Match(diff, m.naming, m.name, m.runs))
    return kept, unmatched


def match_models(matcher_for, models: Mapping[str, object], records: Sequence[Record]
                 ) -> tuple[list[Match], list[Record], dict[str, object]]:
    """``(matched, unmatched, widened)``: ``records`` matched against ``models`` (``matcher_for(models)``: a
    :class:`~eqxdiff.loading.lora.Matcher` of them), again against the widened models if the file widens any
    (:func:`widened_models`: component -> its widened model), replacements turned into differences
    (:func:`replacements_as_differences`). Abstract models (``jax.ShapeDtypeStruct`` leaves) stay abstract."""
    matched, unmatched = matcher_for(models).match(records)
    widened = widened_models(matched, models)
    if widened:
        models = {**models, **widened}
        matched, unmatched = matcher_for(models).match(records)
    matched, refused = replacements_as_differences(matched, models)
    return matched, unmatched + refused, widened


__all__ = ["match_models", "replacements_as_differences", "widened_models"]
