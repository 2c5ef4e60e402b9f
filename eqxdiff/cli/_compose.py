"""What ``eqxdiff-generate`` runs beyond one folder's pipeline: ControlNet models added to a base model (or a ControlNet
pipeline folder's own nets) with their control images and scales, a refiner that finishes the base's latents, and a
UNet in place of the base's.

- :func:`run_class`: the pipeline class a command line runs. The ``--model`` folder's, or with ``--controlnet`` its
  ControlNet pipeline: the class of the family table that extends the base class by a ``controlnet`` component
  (Stable Diffusion's and SDXL's today; a new family's ControlNet pipeline is found the same way). With ``--image``
  the ControlNet pipeline that takes a picture to start from (its ``__call__`` has ``control_image``), with
  ``--mask`` the one that inpaints (its own ``__call__`` has ``mask_image``).
- :class:`ControlNetOptions` (``--controlnet``, ``--control-image``, ``--controlnet-scale``, repeatable, one per
  net in order; ``--control-mode`` per control image for ControlNet-Union, whose pipeline is picked by the
  ``--controlnet`` folder's model class) and :func:`control_kwargs`, which checks them against the nets' configs
  before anything loads and turns them into the call's arguments. The start/end/guess options are the pipeline's own flags.
- :func:`check_refiner`, :func:`refiner_class` and :func:`refiner_kwargs`: a refiner folder finishing the base's
  latents (SDXL's ensemble of experts: the base stops at ``--denoising-end``, the refiner starts there; a ControlNet
  base too; with ``--mask`` the refiner folder inpaints under the same mask, as diffusers' recipe).
- :func:`check_unet` and :func:`load_unet`: ``--unet``, a UNet in place of the base's (a distilled one such as
  SDXL-Lightning's or Hyper-SD's, published as one ``.safetensors`` file in diffusers' names without a config: read
  into the base UNet's config, as ``eqxdiff.load(file, config=base, subfolder="unet")``; or a UNet folder).
"""

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import tyro
from PIL import Image

from ..core import family_names, resolve_class
from ..loading import PICKLE_SUFFIXES, CheckpointError, SafetensorsFile, is_hub_id, load, pickle_error
from ..models.controlnet import ControlNetModel
from ..nn import with_attention_implementation
from ..parallel import DEFAULT_RULES, sharding_fn
from ..pipelines import InputError, pipeline_class_for, read_image

CONTROLNET = "controlnet"  # the component a ControlNet pipeline adds to its base
UNET = "unet"  # the component --unet replaces
# What a UNet's tensors say of the config keys the pipeline feeds it (latent channels in and out, the text encoders'
# width): (key, tensor in diffusers' names or a suffix of one, the axis of its PyTorch shape). A --unet must agree
# with the --model UNet on these; its blocks may differ (a distilled UNet).
UNET_INTERFACE = (("in_channels", "conv_in.weight", 1), ("out_channels", "conv_out.weight", 0),
                  ("cross_attention_dim", ".attn2.to_k.weight", 1))
SCALE = "controlnet_conditioning_scale"
# A refiner call's arguments that the hand-off sets (the base's own go to the base only), and --ip-adapter's image
# prompt and masks (the adapter goes on the --model pipeline alone, as LoRAs do). An inpainting run's mask goes to both.
HANDOFF = ("image", "strength", "denoising_start", "denoising_end", "latents", "output_type", "ip_adapter_image",
           "ip_adapter_masks")
# What a refiner's image check sees before loading: latents handed over (any 4-channel array).
HANDED_LATENTS = np.zeros((1, 1, 1, 4), np.float32)


@dataclasses.dataclass(frozen=True)
class ControlNetOptions:
    """ControlNet: nets added to the --model base (a Stable Diffusion 1.x/2.x or SDXL folder, Hub id or single file),
    or the nets of a ControlNet pipeline --model. --image makes it image-to-image (SD 1.x/2.x)."""

    controlnet: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """A ControlNet model folder or Hub id (config.json + weights) for the --model base; repeat the flag for several
    nets (a multi-ControlNet, residuals summed)."""
    control_image: Annotated[tuple[Path, ...], tyro.conf.UseAppendAction] = ()
    """The control image file (edges, depth, pose ...) of each net, in --controlnet order: one per net. Resized to
    the output size, which defaults to the first one's. A pipeline whose model reads a control image itself (Flux's
    Canny and Depth models) takes one, resized to its output size."""
    controlnet_scale: Annotated[tuple[float, ...], tyro.conf.UseAppendAction] = ()
    """Each net's conditioning scale (controlnet_conditioning_scale), in --controlnet order: one value for every
    net, or one per net; default: the pipeline's (1.0; 0.8 for image-to-image, as diffusers)."""
    control_mode: Annotated[tuple[int, ...], tyro.conf.UseAppendAction] = ()
    """ControlNet-Union: the control mode of each --control-image, in the same order (the index of canny, depth,
    pose ... among the net's control types). One union net reads several images (a scale each); several nets one
    each."""


def _names(cls) -> set[str]:
    return {c.name for c in cls.COMPONENTS}


def is_controlnet(cls) -> bool:
    """``cls`` is a ControlNet pipeline (it has a ``controlnet`` component)."""
    return CONTROLNET in _names(cls)


def _parameters(cls) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(cls.__call__).parameters


def control_argument(cls) -> str:
    """The ``__call__`` argument of ControlNet pipeline ``cls`` taking the control images: ``control_image`` where
    ``image`` is the picture to start from (image-to-image) or the pipeline names it so (ControlNet-Union), else
    ``image`` (diffusers' names)."""
    return "control_image" if "control_image" in _parameters(cls) else "image"


def starts_from_image(cls) -> bool:
    """ControlNet pipeline ``cls`` starts from a picture: its ``__call__`` takes ``image`` and ``control_image``."""
    return {"image", "control_image"} <= set(_parameters(cls))


def takes_mask(cls) -> bool:
    """ControlNet pipeline ``cls`` inpaints: its own ``__call__`` takes ``mask_image``."""
    return "mask_image" in _parameters(cls)


def takes_control_image(cls) -> bool:
    """Pipeline ``cls`` without a ControlNet takes a control image itself (its transformer reads it: Flux's Canny and
    Depth models): ``--control-image`` once gives its ``control_image``."""
    return not is_controlnet(cls) and "control_image" in _parameters(cls)


def takes_modes(cls) -> bool:
    """ControlNet pipeline ``cls`` takes a ``control_mode`` per control image (ControlNet-Union)."""
    return "control_mode" in _parameters(cls)


def _controlnet_classes() -> list[type]:
    classes = {resolve_class(name) for name in family_names("pipeline")}
    return sorted((c for c in classes if isinstance(c, type) and is_controlnet(c)), key=lambda c: c.__name__)


def _base_name(cls) -> str:
    """The pipeline a ControlNet class extends (its first ancestor without a ControlNet)."""
    return next((b.__name__ for b in cls.__mro__[1:] if hasattr(b, "COMPONENTS") and not is_controlnet(b)),
                cls.__name__)


def controlnet_class(base: type, *, image_to_image: bool, net: type | None = None, mask: bool = False) -> type:
    """The ControlNet pipeline class for ``base`` (a pipeline class, or a ControlNet class to switch to
    image-to-image or inpainting): a class of the family table that extends ``base`` by a ``controlnet`` component
    (or, for a ControlNet ``base``, has its components), text-to-image, image-to-image or inpainting (``mask``),
    running ``net`` (a model class: a pipeline's ``NET_CLASS``; default any). Raises ``InputError`` naming the flag
    to leave out when there is none."""
    wanted = _names(base) | {CONTROLNET}
    found: dict[tuple[bool, bool], type] = {}
    for cls in _controlnet_classes():
        if issubclass(cls, base) and _names(cls) == wanted and net in (None, getattr(cls, "NET_CLASS", None)):
            found.setdefault((starts_from_image(cls), takes_mask(cls)), cls)
    task = (image_to_image or mask, mask)
    if task in found:
        return found[task]
    if found and mask:
        raise InputError(f"--mask: eqxdiff has no ControlNet inpainting pipeline for {base.__name__}; leave out "
                         "--mask or the ControlNet")
    if found:
        raise InputError(f"eqxdiff has no image-to-image ControlNet pipeline for {base.__name__}; leave out --image "
                         "(the control images go to --control-image)")
    runs = [c for c in _controlnet_classes() if net in (None, getattr(c, "NET_CLASS", None))]
    bases = sorted({_base_name(c) for c in runs})
    what = "ControlNets" if net is None else f"{net.__name__}s"
    raise InputError(f"eqxdiff has no ControlNet pipeline for the --model folder's {base.__name__}"
                     f"{'' if net is None else f' with a {net.__name__}'}; {what} run on {', '.join(bases)}: pass one "
                     "of those as --model, or leave out --controlnet")


def run_class(cls: type, *, controlnet: bool, image: bool, mask: bool, net: type | None = None) -> type:
    """The class a command line runs: ``cls`` (the ``--model`` folder's), its ControlNet pipeline with
    ``--controlnet``, the image-to-image ControlNet pipeline with ``--image``, the inpainting one with ``--mask``.
    ``net``: the model class of the first ``--controlnet``."""
    if controlnet and is_controlnet(cls):
        raise InputError(f"--model is a {cls.__name__}, which holds its ControlNet(s) already; leave out --controlnet "
                         "(or pass its base model as --model)")
    if not (controlnet or is_controlnet(cls)):
        return cls
    if controlnet or (image and not starts_from_image(cls)) or (mask and not takes_mask(cls)):
        return controlnet_class(cls, image_to_image=image, net=net, mask=mask)
    return cls


def excluded_arguments(cls) -> tuple[str, ...]:
    """The ``__call__`` arguments of ``cls`` that are not flags of their own: a ControlNet pipeline's control
    images and scales (``--control-image``, ``--controlnet-scale``) and the inpainting mask; for text-to-image also
    what needs a picture to start from."""
    if not is_controlnet(cls):
        return ("control_image",) if takes_control_image(cls) else ()
    modes = ("control_mode",) if takes_modes(cls) else ()
    return (control_argument(cls), SCALE, *(() if takes_mask(cls) else ("mask_image",)), *modes) + (
        () if starts_from_image(cls) else ("image", "strength", "denoising_start"))


# -- the nets -----------------------------------------------------------------------------------------------------

def folder_nets(read: Callable[[str], Mapping | None]) -> int:
    """How many nets a ControlNet pipeline folder holds (``read``: its JSON files): a ``MultiControlNetModel`` (or
    ``MultiControlNetUnionModel``) in ``controlnet``, ``controlnet_1`` ..., else one."""
    entry = (read("model_index.json") or {}).get(CONTROLNET) or [None, None]
    if entry[1] not in ("MultiControlNetModel", "MultiControlNetUnionModel"):
        return 1
    n = 0
    while read(f"{CONTROLNET}{'' if n == 0 else f'_{n}'}/config.json") is not None:
        n += 1
    return max(n, 1)


def net_class(paths: Sequence[str], reader) -> type | None:
    """The model class the first ``--controlnet``'s ``config.json`` names if a ControlNet pipeline runs it
    (``None`` otherwise, or if it cannot be read: the checks after parsing say why)."""
    try:
        config = reader(paths[0])("config.json") if paths else None
    except (OSError, ValueError):
        return None
    name = config.get("_class_name") if isinstance(config, Mapping) else None
    found = resolve_class(name) if isinstance(name, str) else None
    runs = {getattr(c, "NET_CLASS", None) for c in _controlnet_classes()}
    return found if isinstance(found, type) and found in runs else None


def check_controlnets(paths: Sequence[str], reader, base_read: Callable[[str], Mapping | None],
                      net: type | None = None) -> None:
    """Each ``--controlnet`` is a ``net`` model (default ``ControlNetModel``; its ``config.json``, read with
    ``reader(path)``) whose width fits the ``--model`` UNet's (``cross_attention_dim``, ``block_out_channels``;
    skipped where the base's UNet config is unknown, as for a single file without ``--config``)."""
    net = net or ControlNetModel
    unet = base_read("unet/config.json") or {}
    for path in paths:
        if Path(path).expanduser().is_file():
            raise InputError(f"--controlnet {path!r} is a file; pass a ControlNet model folder (config.json and "
                             "diffusion_pytorch_model.safetensors) or its Hub id")
        config = reader(path)("config.json")
        if config is None:
            raise CheckpointError(f"--controlnet {path!r} holds no config.json; pass a ControlNet model folder "
                                  "(config.json and diffusion_pytorch_model.safetensors) or its Hub id")
        name = config.get("_class_name")
        found = resolve_class(name) if isinstance(name, str) else None
        if not (isinstance(found, type) and issubclass(found, net)):
            raise CheckpointError(f"--controlnet {path!r} holds a {name!r} (config.json _class_name), not a "
                                  f"{net.__name__}; pass a ControlNet model folder or Hub id (nets of one kind)")
        for key in ("cross_attention_dim", "block_out_channels"):
            ours, theirs = config.get(key), unet.get(key)
            if ours is not None and theirs is not None and _value(ours) != _value(theirs):
                raise InputError(f"--controlnet {path!r} has {key}={_value(ours)} but the --model UNet has "
                                 f"{_value(theirs)}: it was trained for another base model; pass a ControlNet of "
                                 "this model's family")


def _value(v):
    return tuple(v) if isinstance(v, list) else v


def control_kwargs(cls: type, options: ControlNetOptions, nets: int) -> dict[str, Any]:
    """The ControlNet arguments of a call of ``cls`` with ``nets`` nets: the control images (read here as PIL RGB
    images, as diffusers' ``load_image`` gives them: resized with Lanczos to the output size) under
    :func:`control_argument`, and ``controlnet_conditioning_scale`` if ``--controlnet-scale`` was given. Counts
    that do not match the nets raise ``InputError`` naming the flags."""
    if takes_control_image(cls):
        if options.controlnet_scale or options.control_mode or len(options.control_image) != 1:
            flag = ("--controlnet-scale" if options.controlnet_scale else "--control-mode" if options.control_mode
                    else f"--control-image given {len(options.control_image)} times:")
            raise InputError(f"{flag} {cls.__name__} takes one --control-image (its model reads it; no ControlNet "
                             "scales or modes)")
        return {"control_image": _control_images(options)[0]}
    if not is_controlnet(cls):
        if options.control_image or options.controlnet_scale or options.control_mode:
            flag = ("--control-image" if options.control_image else "--controlnet-scale" if options.controlnet_scale
                    else "--control-mode")
            raise InputError(f"{flag} needs a ControlNet: pass --controlnet FOLDER_OR_HUB_ID (or a ControlNet pipeline "
                             "as --model)")
        return {}
    if takes_modes(cls):
        return _union_kwargs(cls, options, nets)
    if options.control_mode:
        raise InputError(f"--control-mode is for ControlNet-Union nets; {cls.__name__} takes none: leave it out")
    where = f"{nets} ControlNet{'s' if nets > 1 else ''}"
    if len(options.control_image) != nets:
        given = len(options.control_image)
        raise InputError(f"--control-image given {given} time{'s' if given != 1 else ''} for {where}; give one "
                         f"control image per net{', in --controlnet order' if options.controlnet else ''}")
    if len(options.controlnet_scale) not in (0, 1, nets):
        raise InputError(f"--controlnet-scale given {len(options.controlnet_scale)} times for {where}; give one "
                         "value for every net or one per net")
    images = _control_images(options)
    out: dict[str, Any] = {control_argument(cls): images[0] if nets == 1 else images}
    if options.controlnet_scale:
        scales = list(options.controlnet_scale)
        out[SCALE] = scales[0] if len(scales) == 1 else scales
    return out


def _control_images(options: ControlNetOptions) -> list:
    images = []
    for path in options.control_image:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--control-image {os.fspath(path)!r}: no such file")
        try:
            images.append(Image.fromarray(read_image(path)))
        except InputError as e:
            raise InputError(f"--control-image: {e}") from None
    return images


def _union_kwargs(cls: type, options: ControlNetOptions, nets: int) -> dict[str, Any]:
    """:func:`control_kwargs` for ControlNet-Union: a list of control images, their modes and scales."""
    given, modes = len(options.control_image), len(options.control_mode)
    if given == 0 or (nets > 1 and given != nets):
        want = f"one per net, in --controlnet order ({nets} nets)" if nets > 1 else "one or more"
        raise InputError(f"--control-image given {given} times for {cls.__name__}; give {want}")
    if modes != given:
        raise InputError(f"--control-mode given {modes} time{'s' if modes != 1 else ''} for {given} --control-image; "
                         "give the control mode of each control image, in the same order")
    if len(options.controlnet_scale) not in (0, 1, given):
        raise InputError(f"--controlnet-scale given {len(options.controlnet_scale)} times for {given} control "
                         "images; give one value for every image or one per image")
    out: dict[str, Any] = {control_argument(cls): _control_images(options),
                           "control_mode": list(options.control_mode)}
    if options.controlnet_scale:
        scales = list(options.controlnet_scale)
        out[SCALE] = scales[0] if len(scales) == 1 else scales
    return out


def check_window(kwargs: Mapping[str, Any]) -> None:
    """``--control-guidance-start`` < ``--control-guidance-end``, both in [0, 1]."""
    start, end = kwargs.get("control_guidance_start"), kwargs.get("control_guidance_end")
    if start is not None and end is not None and not 0.0 <= start < end <= 1.0:
        raise InputError(f"--control-guidance-start {start} and --control-guidance-end {end} must satisfy "
                         "0 <= start < end <= 1 (the fractions of the steps the nets run in)")


def effective_scales(cls: type, kwargs: Mapping[str, Any], nets: int) -> list[float] | None:
    """Each net's conditioning scale in the call: the given one(s), else the pipeline's default."""
    scale = kwargs.get(SCALE)
    if scale is None:
        default = _parameters(cls)[SCALE].default if SCALE in _parameters(cls) else None
        scale = default if isinstance(default, (int, float)) else getattr(cls, "DEFAULT_CONTROL_SCALE", None)
    if scale is None:
        return None
    return [float(s) for s in scale] if isinstance(scale, (list, tuple)) else [float(scale)] * nets


def load_controlnets(paths: Sequence[str], *, dtype, mesh=None, rules=None, attention: str | None = None,
                     scan_layers: bool = False) -> list:
    """The ``--controlnet`` models, each read straight into ``dtype`` (and onto its sharding on a mesh)."""
    sharding = None if mesh is None else sharding_fn(mesh, rules or DEFAULT_RULES)
    nets = [load(path, dtype=dtype, sharding=sharding, scan_layers=scan_layers) for path in paths]
    return [with_attention_implementation(n, attention) if attention else n for n in nets]


# -- the refiner --------------------------------------------------------------------------------------------------

def check_refiner(base: type, refiner: type, base_flags: Sequence[str], refiner_flags: Sequence[str],
                  given: Mapping[str, Any]) -> None:
    """A ``--refiner`` run can hand over: the base returns latents and stops at ``--denoising-end``
    (``output_type`` and ``denoising_end`` arguments), the refiner starts from them (``image`` and
    ``denoising_start``; with ``--mask`` it inpaints: :func:`refiner_class`). A ControlNet base hands over where
    diffusers' does (text-to-image and inpainting), not from ``--image`` alone (its image-to-image pipelines take no
    ``denoising_end``)."""
    if "denoising_end" not in base_flags or not _takes(base, "output_type"):
        raise InputError(f"--refiner: the --model's {base.__name__} cannot hand over latents (it takes no "
                         "denoising_end); leave out --refiner")
    if is_controlnet(base) and starts_from_image(base) and not takes_mask(base):
        raise InputError(f"--refiner with --image and a ControlNet: {base.__name__} stops at no denoising_end (as "
                         "diffusers', it hands nothing over); leave out --refiner or --image (a ControlNet base hands "
                         "over text-to-image and, with --mask, inpainting)")
    if "image" not in refiner_flags or "denoising_start" not in refiner_flags:
        raise InputError(f"--refiner holds a {refiner.__name__}, which cannot start from handed-over latents (no "
                         "image and denoising_start); pass a refiner (image-to-image) pipeline such as SDXL's")
    if given.get("mask_image") is not None and "mask_image" not in refiner_flags:
        raise InputError(f"--mask with --refiner: the --refiner's {refiner.__name__} takes no mask; leave out --mask "
                         "or --refiner")


def _takes(cls, name: str) -> bool:
    """A call of ``cls`` takes ``name``: its ``__call__`` or one it passes its keywords on to (a ControlNet's)."""
    return any(name in _parameters(k) for k in cls.__mro__ if "__call__" in k.__dict__)


def _requires_mask(cls) -> bool:
    return "mask_image" in getattr(cls, "REQUIRED_INPUTS", ())


def refiner_class(folder_class: type, *, mask: bool) -> type:
    """The class a ``--refiner`` folder of ``folder_class`` runs as: its own; with ``--mask`` its family's inpainting
    pipeline (a class of the family table without ControlNet that requires ``mask_image`` and loads the folder:
    :func:`~eqxdiff.pipelines.pipeline_class_for`), as diffusers' recipe loads SDXL's refiner folder as
    ``StableDiffusionXLInpaintPipeline`` to finish an inpainting base's latents under the same mask. An
    ``InputError`` naming the flags where the family has none."""
    if not mask or _requires_mask(folder_class):
        return folder_class
    for name in sorted(family_names("pipeline")):
        cls = resolve_class(name)
        if not isinstance(cls, type) or not _requires_mask(cls) or is_controlnet(cls):
            continue
        try:
            return pipeline_class_for(folder_class, cls, where="", holds="")
        except CheckpointError:
            continue
    raise InputError(f"--mask with --refiner: eqxdiff has no inpainting pipeline that loads the --refiner folder's "
                     f"{folder_class.__name__} (the refiner would finish the masked region under the same mask); "
                     "leave out --mask or --refiner")


def refiner_kwargs(refiner_flags: Sequence[str], kwargs: Mapping[str, Any], latents) -> dict[str, Any]:
    """The refiner call's arguments: the base call's that the refiner takes (prompts, steps, guidance, seed,
    micro-conditioning, an inpainting run's ``mask_image`` ...), ``image`` the handed-over ``latents`` and
    ``denoising_start`` the base's ``denoising_end`` (without it the refiner refines the finished latents at its
    default ``strength``)."""
    out = {k: v for k, v in kwargs.items() if k in refiner_flags and k not in HANDOFF}
    out["image"] = latents
    if kwargs.get("denoising_end") is not None:
        out["denoising_start"] = kwargs["denoising_end"]
    return out


# -- the UNet -------------------------------------------------------------------------------------------------------

def check_unet(cls: type, path: str, reader, base_read: Callable[[str], Mapping | None]) -> None:
    """``--unet path`` can replace the UNet of a ``cls`` pipeline, before anything loads: ``cls`` has a ``unet``
    component; ``path`` is a ``.safetensors`` file (a pickle gets :func:`eqxdiff.loading.pickle_error`'s message) that
    opens and holds a UNet in diffusers' names, or a folder / Hub id whose ``config.json`` (read with
    ``reader(path)``) names a class ``cls`` runs as its UNet; and either agrees with the ``--model`` UNet's config
    (``base_read("unet/config.json")``; skipped where unknown, as for a single file without ``--config``) on
    :data:`UNET_INTERFACE`. Raises ``InputError``, ``CheckpointError`` or ``FileNotFoundError`` naming the flag."""
    component = next((c for c in cls.COMPONENTS if c.name == UNET), None)
    if component is None:
        models = ", ".join(c.name for c in cls.COMPONENTS if c.kind == "model")
        raise InputError(f"--unet replaces a pipeline's UNet, but the --model folder's {cls.__name__} has none (its "
                         f"models: {models}); leave out --unet")
    base = base_read(f"{UNET}/config.json") or {}
    local = Path(path).expanduser()
    if local.is_file():
        ours, where = _file_interface(local, path), "by its tensors' shapes"
    elif local.is_dir() or is_hub_id(path):
        ours, where = _folder_interface(cls, component, path, reader), "in its config.json"
    else:
        raise FileNotFoundError(f"--unet {path!r}: no such file or folder; pass a UNet .safetensors file in "
                                "diffusers' names (sdxl_lightning_4step_unet.safetensors ...) or a UNet folder")
    for key, value in ours.items():
        theirs = base.get(key)
        if theirs is not None and value is not None and _value(theirs) != _value(value):
            raise InputError(f"--unet {path!r} has {key}={_value(value)} ({where}) but the --model UNet has "
                             f"{_value(theirs)}: it was made for another base model; pass a UNet of this model's "
                             "family")


def _file_interface(file: Path, path: str) -> dict[str, Any]:
    """:data:`UNET_INTERFACE` as lone UNet file ``file``'s tensor shapes give it (its header alone is read)."""
    if file.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(f"--unet: {pickle_error(file)}")
    if file.suffix.lower() != ".safetensors":
        raise CheckpointError(f"--unet {path!r} is not a .safetensors file; pass a UNet .safetensors file in "
                              "diffusers' names or a UNet folder (config.json and diffusion_pytorch_model.safetensors)")
    try:
        header = SafetensorsFile(file)
    except CheckpointError as e:
        raise CheckpointError(f"--unet: {e}") from None
    names = header.names()
    if "conv_in.weight" not in names:
        raise CheckpointError(f"--unet {path!r} holds no conv_in.weight: not a UNet in diffusers' names (as "
                              "SDXL-Lightning's *_unet.safetensors and Hyper-SDXL's *-Unet.safetensors are); a "
                              "whole-model single file (A1111, ComfyUI) goes to --model, with --config")
    out = {}
    for key, name, axis in UNET_INTERFACE:
        found = next((n for n in names if n == name or (name.startswith(".") and n.endswith(name))), None)
        out[key] = None if found is None else header.shape(found)[axis]
    return out


def _folder_interface(cls: type, component, path: str, reader) -> dict[str, Any]:
    """:data:`UNET_INTERFACE` from UNet folder (or Hub id) ``path``'s ``config.json``, whose class ``cls`` must run as
    its UNet."""
    config = reader(path)("config.json")
    if config is None:
        where = "is no local file or folder, and the Hugging Face Hub gave no config.json for it" if is_hub_id(path) \
            else "holds no config.json"
        raise CheckpointError(f"--unet {path!r} {where}; pass a UNet folder (config.json and "
                              "diffusion_pytorch_model.safetensors), its Hub id, or a UNet .safetensors file")
    name, accepted = config.get("_class_name"), cls.component_classes(component)
    if accepted and name not in accepted:
        raise CheckpointError(f"--unet {path!r} holds a {name!r} (config.json _class_name), not a "
                              f"{' or '.join(accepted)}, which a {cls.__name__} runs as its UNet; pass a UNet folder "
                              "or file")
    return {key: config.get(key) for key, _, _ in UNET_INTERFACE}


def load_unet(path: str, pipe, *, dtype, attention: str | None = None, scan_layers: bool = False):
    """The ``--unet`` model for pipeline ``pipe``, read straight into ``dtype`` and, on ``pipe``'s mesh, onto its
    sharding by ``pipe``'s rules: a lone file into the config of ``pipe``'s UNet (what ``eqxdiff.load(file,
    config=<--model>, subfolder="unet")`` reads; also right for a single-file ``--model``), a folder or Hub id with
    its own ``config.json``. ``scan_layers`` stacks its layers where ``pipe``'s class scans its UNet."""
    component = next(c for c in type(pipe).COMPONENTS if c.name == UNET)
    sharding = None if pipe.mesh is None else sharding_fn(pipe.mesh, pipe.rules or DEFAULT_RULES)
    base = getattr(pipe, UNET)
    lone = {"config": base.config, "model_class": type(base)} if Path(path).expanduser().is_file() else {}
    unet = load(path, dtype=dtype, sharding=sharding, scan_layers=scan_layers and component.scan, **lone)
    return with_attention_implementation(unet, attention) if attention else unet
