"""Schedulers by diffusers class name (``_class_name``) and by short name, and ``scheduler_from_config``."""

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ..core import ConfigError
from ._base import AbstractScheduler
from .ddim import DDIMScheduler
from .ddpm import DDPMScheduler
from .dpm_solver import DPMSolverMultistepScheduler
from .euler import EulerAncestralDiscreteScheduler, EulerDiscreteScheduler
from .flow_match import FlowMatchEulerDiscreteScheduler
from .lcm import LCMScheduler, TCDScheduler
from .lms import LMSDiscreteScheduler
from .pndm import PNDMScheduler
from .unipc import UniPCMultistepScheduler

SCHEDULER_CLASSES: Mapping[str, type[AbstractScheduler]] = MappingProxyType({
    cls.__name__: cls for cls in (DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler,
                                  EulerAncestralDiscreteScheduler, EulerDiscreteScheduler, LMSDiscreteScheduler,
                                  PNDMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler,
                                  LCMScheduler, TCDScheduler)})


@dataclasses.dataclass(frozen=True)
class SchedulerChoice:
    """A short name's scheduler class and the config keys it forces (on top of the checkpoint's)."""

    cls: type[AbstractScheduler]
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)


SCHEDULERS: Mapping[str, SchedulerChoice] = MappingProxyType({
    "ddim": SchedulerChoice(DDIMScheduler),
    "pndm": SchedulerChoice(PNDMScheduler),
    "euler": SchedulerChoice(EulerDiscreteScheduler),
    "euler_a": SchedulerChoice(EulerAncestralDiscreteScheduler),
    "lms": SchedulerChoice(LMSDiscreteScheduler),
    "dpm++2m": SchedulerChoice(DPMSolverMultistepScheduler,
                               {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": False}),
    "dpm++2m_karras": SchedulerChoice(DPMSolverMultistepScheduler,
                                      {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True}),
    "ddpm": SchedulerChoice(DDPMScheduler),
    "flow_euler": SchedulerChoice(FlowMatchEulerDiscreteScheduler),
    "unipc": SchedulerChoice(UniPCMultistepScheduler),
    "lcm": SchedulerChoice(LCMScheduler),
    "tcd": SchedulerChoice(TCDScheduler),
})


def scheduler_from_config(raw: Mapping[str, Any], name: str | None = None, **overrides) -> AbstractScheduler:
    """The scheduler a ``scheduler_config.json`` dict describes.

    Without ``name`` its ``_class_name`` picks the class. With ``name`` (a key of :data:`SCHEDULERS`) that
    scheduler is built from the same dict, like diffusers' ``X.from_config(other.config)``: keys both classes
    know (betas, prediction type, spacing, ...) carry over, the rest take the new class's defaults, keys diffusers
    recorded as defaulted (``_use_default_values``) are dropped. ``overrides`` set config keys last: after the
    dict's and the keys the name sets (``"dpm++2m_karras"``'s ``use_karras_sigmas=True``, which an override may
    change).
    """
    if name is None:
        class_name = raw.get("_class_name")
        if class_name is None:
            raise ConfigError(f"scheduler config has no _class_name; pass name= one of {list(SCHEDULERS)}")
        if class_name not in SCHEDULER_CLASSES:
            raise ConfigError(f"unsupported scheduler _class_name={class_name!r}; eqxdiff supports "
                              f"{list(SCHEDULER_CLASSES)} (or pass name= one of {list(SCHEDULERS)})")
        cls, forced = SCHEDULER_CLASSES[class_name], {}
    elif name in SCHEDULERS:
        cls, forced = SCHEDULERS[name].cls, SCHEDULERS[name].overrides
    else:
        raise ValueError(f"unknown scheduler name {name!r}; choose one of {list(SCHEDULERS)}")
    return cls.from_config(raw, **{**forced, **overrides})
