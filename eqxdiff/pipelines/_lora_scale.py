"""One call's LoRA scale, as diffusers takes it: ``cross_attention_kwargs={"scale": s}`` (the UNet families),
``joint_attention_kwargs`` (Flux), ``attention_kwargs`` (Wan, LTX-Video): the family names the argument
(:attr:`LoraScaleMixin.LORA_SCALE_ARGUMENT`), :func:`~eqxdiff.pipelines.checked_call` takes it off the call and runs
the call with every adapter's strength multiplied by ``s`` (:meth:`LoraScaleMixin.lora_scaled`).

diffusers multiplies the scaling of each active PEFT adapter by ``s`` in every model that runs with the argument
(``scale_lora_layers`` in the denoiser's forward, and in ``encode_prompt`` on the text encoders of the families that
pass ``lora_scale`` there) and divides it back afterwards; fused weights keep theirs. Here every model holding
adapters has their traced strengths rewritten on the host for the length of the call: values only, so a new scale
compiles nothing, and adapters fused into the weights are untouched (a fused model keeps only its unfused entries).
One difference, by design: after a call at scale 0, diffusers' ``unscale_lora_layers`` resets every active adapter
to strength 1 (``set_scale(name, 1.0)``), losing ``set_adapters``' weights; here the next call has them as before.
"""

import contextlib
import math
from collections.abc import Mapping
from numbers import Real
from typing import Any, ClassVar

import numpy as np

from .. import nn
from ._checks import InputError, InputTypeError

__all__ = ["LoraScaleMixin", "call_lora_scale"]


def call_lora_scale(argument: str, value: Any) -> float:
    """The LoRA scale a call's ``argument`` (``cross_attention_kwargs`` ...) gives: its ``"scale"`` (default 1.0).
    Any other key is an :class:`~eqxdiff.pipelines.InputError` naming it: diffusers hands those to attention
    processors, which eqxdiff does not have (:func:`~eqxdiff.pipelines.checked_call` has already moved the keys that
    are the call's own arguments, such as the UNet pipelines' ``ip_adapter_masks``, to the call, and refused those
    it does not take by design with their reason)."""
    if value is None:
        return 1.0
    if not isinstance(value, Mapping):
        raise InputTypeError(f"{argument}={value!r} must be a dict such as {{'scale': 0.5}} (the call's LoRA scale)")
    other = sorted(map(str, set(value) - {"scale"}))
    if other:
        raise InputError(f"{argument} holds {other}: eqxdiff takes only 'scale' there (the call's LoRA scale); "
                         "diffusers passes the other keys to attention processors, which eqxdiff does not have")
    scale = value.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (Real, np.number)) or not math.isfinite(float(scale)):
        raise InputTypeError(f"{argument}={{'scale': {scale!r}}}: the scale must be a finite number (the LoRA "
                             "strengths' multiplier for this call)")
    return float(scale)


class LoraScaleMixin:
    """The per-call LoRA scale of :class:`~eqxdiff.pipelines.DiffusionPipeline` (see the module docstring)."""

    # diffusers' call argument whose "scale" multiplies the adapters' strengths for one call (None: the family takes
    # none); checked_call takes it and shows it in the family's __call__ signature.
    LORA_SCALE_ARGUMENT: ClassVar[str | None] = None

    @contextlib.contextmanager
    def lora_scaled(self, scale: float):
        """Within the block, every model holding adapters has their strengths multiplied by ``scale`` (traced values
        rewritten on the host: nothing compiles); the models are given back as they were afterwards."""
        state = self.__dict__.get("_lora_state")
        if scale == 1.0 or state is None or not state.slots:
            yield
            return
        kept = {component: getattr(self, component) for component in state.slots}
        try:
            for component, model in kept.items():
                setattr(self, component, _scaled(model, state.slots[component], scale))
            yield
        finally:
            for component, model in kept.items():
                setattr(self, component, model)


def _scaled(model, paths, scale: float):
    changes = {}
    for path in paths:
        adapters = nn.resolve_site(model, path).adapters
        if adapters is not None:
            scales = np.asarray(adapters.scales, np.float32) * np.float32(scale)
            changes[path] = nn.Adapters(adapters.entries, nn.place_like(scales, adapters.scales), adapters.enabled)
    return nn.with_adapters(model, changes)
