"""What the ControlNet pipelines share (SD 1.x/2.x and SDXL with ControlNet, SDXL with ControlNet-Union): the
control images as the nets take them, each net's scale at each step, the call's :class:`ControlInput`, the
:class:`ControlNetDenoiser` running the net(s) before the UNet, and :class:`ControlNetPipelineMixin`, which a
ControlNet pipeline puts before its family's pipeline class (the ``controlnet`` component, loading and saving
several nets, the denoiser of a call).

The pipeline classes are in :mod:`eqxdiff.pipelines.controlnet` and :mod:`eqxdiff.pipelines.controlnet_union`.
"""

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from PIL import Image

from .._typing import Array, Float
from ..loading import CheckpointError, load, save_pretrained
from ..models import ip_adapter as ipa
from ..models.controlnet import ControlNetModel, MultiControlNetModel
from ._checks import InputError, InputTypeError, pixel_size, prompt_count
from ._components import Component
from ._images import resize_nearest
from ._unet import UNetDenoiser

__all__ = ["CONTROLNET", "ControlInput", "ControlNetDenoiser", "ControlNetPipelineMixin", "control_input",
           "control_scales", "prepare_control_image"]

CONTROL_IMAGE = "controlnet_cond"  # cond keys controlnet_cond_0, controlnet_cond_1, ...: each net's control images


def prepare_control_image(image, *, height: int | None = None, width: int | None = None, multiple: int = 8,
                          lowest: float = 0.0) -> np.ndarray:
    """A control image as the ControlNet takes it: float32 ``[n, height, width, channels]`` in ``[0, 1]``, as
    diffusers' ``VaeImageProcessor(do_normalize=False)`` makes it.

    ``image``: PIL image(s) (converted to RGB, resized with Lanczos), or arrays ``[n, h, w, c]`` / ``[h, w, c]``
    (uint8, or floats in ``[lowest, 1]``, passed on as they are, as there: an inpainting net's condition marks the
    masked pixels -1; resized nearest-neighbour). ``height`` / ``width`` default to the image's size rounded down to
    a ``multiple`` (the VAE's factor)."""
    pil = _is_pil(image)
    if isinstance(image, Image.Image):
        image = [image]
    if pil:
        w0, h0 = image[0].size
    else:
        arr = np.stack([np.asarray(im) for im in image]) if isinstance(image, (list, tuple)) else np.asarray(image)
        if arr.ndim == 3:
            arr = arr[None]
        if arr.ndim != 4:
            raise InputError(f"a control image must be PIL image(s) or an array [n, height, width, channels] "
                             f"(channels-last), got shape {arr.shape}")
        h0, w0 = arr.shape[1:3]
    height = height or h0 - h0 % multiple
    width = width or w0 - w0 % multiple
    if pil:
        arr = np.stack([np.asarray((im if im.size == (width, height) else
                                    im.resize((width, height), resample=Image.Resampling.LANCZOS)).convert("RGB"))
                        for im in image])
    if arr.dtype == np.uint8:
        arr = arr.astype(np.float32) / 255.0
    elif not np.issubdtype(arr.dtype, np.floating):  # diffusers reads other integers as [0, 1] floats
        raise InputTypeError(f"a control image of dtype {arr.dtype}: pass uint8 (0-255), floats in [{lowest:g}, 1] "
                             "or PIL images (eqxdiff does not guess the range of other integers)")
    else:
        arr = np.asarray(arr, np.float32)
        if arr.min() < lowest or arr.max() > 1:
            raise InputError(f"a float control image must lie in [{lowest:g}, 1] (pass uint8 for 0-255 images)")
    if arr.shape[1:3] != (height, width):
        arr = resize_nearest(arr, height, width)
    return arr


def _is_pil(image) -> bool:
    """Whether a control image is PIL image(s): one, or a non-empty list of them."""
    return isinstance(image, Image.Image) or (isinstance(image, Sequence) and len(image) > 0 and
                                              all(isinstance(im, Image.Image) for im in image))


def per_output(images: np.ndarray, batch: int, num_images_per_prompt: int, where: str = "",
               noun: str = "control image") -> np.ndarray:
    """``images`` ``[n, ...]`` as one per output ``[batch, ...]``: one image for every output, or one per prompt
    repeated ``num_images_per_prompt`` times (diffusers' ``prepare_image``). The error for another count starts with
    ``where`` and calls the images ``noun``."""
    if images.shape[0] == 1:
        return np.repeat(images, batch, axis=0)
    if images.shape[0] * num_images_per_prompt == batch:
        return np.repeat(images, num_images_per_prompt, axis=0)
    raise InputError(f"{where}got {images.shape[0]} {noun}s for {batch // num_images_per_prompt} prompts; pass one "
                     f"{noun} or one per prompt")


def control_scales(scales: Sequence[float], starts: Sequence[float], ends: Sequence[float],
                   num_steps: int) -> np.ndarray:
    """``[num_steps, nets]``: each net's ``controlnet_conditioning_scale`` at each step of the loop, zero where
    ``i / N < start`` or ``(i + 1) / N > end`` (diffusers' ``controlnet_keep``)."""
    keep = [[1.0 - float(i / num_steps < s or (i + 1) / num_steps > e) for s, e in zip(starts, ends)]
            for i in range(num_steps)]
    return (np.asarray(keep, np.float64).reshape(num_steps, len(scales)) * np.asarray(scales, np.float64)
            ).astype(np.float32)


def _per_net(value, n: int, name: str) -> tuple:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * n
    if len(values) != n:
        raise InputError(f"{name} has {len(values)} entries for {n} ControlNets; give one value or one per net")
    return values


@dataclasses.dataclass(frozen=True)
class ControlInput:
    """A call's ControlNet inputs, one entry per net: control images (as given), scales, start and end fractions,
    and whether guess mode is on."""

    images: tuple
    scales: tuple[float, ...]
    starts: tuple[float, ...]
    ends: tuple[float, ...]
    guess_mode: bool
    num_images_per_prompt: int = 1
    lowest: float = 0.0  # the lowest value a float control image may hold (-1: an inpainting net's masked pixels)
    prompts: int | None = None  # the call's prompts, when its arguments say (each image: one, or one per prompt)
    # each control image prepared at its own size, as the pipeline's bound() checked it (() : prepared when needed)
    arrays: tuple[np.ndarray, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def native(self) -> tuple[np.ndarray, ...]:
        """Each control image as :func:`prepare_control_image` makes it at its own size (``multiple=1``): the
        :attr:`arrays` prepared when the call was checked, else prepared now."""
        return self.arrays or tuple(prepare_control_image(im, multiple=1, lowest=self.lowest) for im in self.images)

    def size(self, height: int | None, width: int | None, multiple: int) -> tuple[int, int]:
        """The output size: ``height`` / ``width`` if given, else the first control image's (rounded down to a
        ``multiple``), as diffusers' ControlNet pipelines take it."""
        if height is not None and width is not None:
            return height, width
        h, w = self.native()[0].shape[1:3]
        if (height is None and h < multiple) or (width is None and w < multiple):
            raise InputError(f"the control image has {pixel_size(h, w)} pixels, under the VAE's factor {multiple}: "
                             "it sets no output size; pass a larger control image or set height= and width=")
        return height or h - h % multiple, width or w - w % multiple

    def prepared(self, *, batch: int, height: int, width: int, multiple: int) -> list[np.ndarray]:
        """Each net's control images ``[batch, height, width, c]``: one image for every output, or one per prompt
        repeated ``num_images_per_prompt`` times (diffusers' ``prepare_image``). Those of another size are resized:
        PIL images from the originals (Lanczos), arrays nearest-neighbour (:func:`prepare_control_image`)."""
        out, num_images_per_prompt = [], self.num_images_per_prompt
        for i, (image, arr) in enumerate(zip(self.images, self.native())):
            if arr.shape[1:3] != (height, width):
                arr = (prepare_control_image(image, height=height, width=width, multiple=multiple, lowest=self.lowest)
                       if _is_pil(image) else resize_nearest(arr, height, width))
            out.append(per_output(arr, batch, num_images_per_prompt, f"control image {i}: ", "image"))
        return out


def control_input(controlnet, image, *, scale, start, end, guess_mode: bool) -> ControlInput:
    """Check a call's ControlNet arguments against ``controlnet`` (one net, or a :class:`MultiControlNetModel`)
    and return them per net, as diffusers' ``check_inputs`` does."""
    nets = controlnet.nets if isinstance(controlnet, MultiControlNetModel) else (controlnet,)
    n = len(nets)
    if image is None:
        raise InputError("a ControlNet pipeline needs its control image (image= for text-to-image, control_image= "
                         "for image-to-image)")
    if n > 1:
        if not isinstance(image, (list, tuple)) or len(image) != n:
            raise InputError(f"{n} ControlNets need a list of {n} control images (one per net), got "
                             f"{type(image).__name__}{f' of {len(image)}' if isinstance(image, (list, tuple)) else ''}")
        images = tuple(image)
    else:
        images = (image,)
    scales = tuple(float(s) for s in _per_net(scale, n, "controlnet_conditioning_scale"))
    starts = _per_net(start, n, "control_guidance_start")
    ends = _per_net(end, n, "control_guidance_end")
    for s, e in zip(starts, ends):
        if not 0.0 <= s < e <= 1.0:
            raise InputError(f"control_guidance_start={s} and control_guidance_end={e} must satisfy 0 <= start < end "
                             "<= 1")
    # diffusers: the first net's global_pool_conditions turns guess mode on
    guess = bool(guess_mode) or nets[0].config.global_pool_conditions
    return ControlInput(images, scales, tuple(map(float, starts)), tuple(map(float, ends)), guess)


def _controlnets(value, net: type = ControlNetModel, multi: type = MultiControlNetModel):
    """A pipeline's ``controlnet`` component from one ``net``, a list of them or a ``multi`` of them."""
    if isinstance(value, (list, tuple)):
        return value[0] if len(value) == 1 else multi(value)
    if not isinstance(value, (net, multi)):
        raise TypeError(f"controlnet must be a {net.__name__}, a list of them or a {multi.__name__}, got "
                        f"{type(value).__name__}")
    return value


# -- in the loop --------------------------------------------------------------------------------------------------

class ControlNetDenoiser(UNetDenoiser):
    """The ControlNet(s), then the UNet with their residuals. ``cond`` holds each net's control images
    (``controlnet_cond_{i}``, ``[n, H, W, c]``, for the unguided batch) besides the UNet's arrays; ``scales`` is the
    ``[steps, nets]`` table of each net's scale at each step index of the schedule. With guidance (a ``[2n]`` batch
    of ``[negative; positive]``) the nets see the control images twice, or in ``guess_mode`` only the positive half,
    the negative half's residuals being zeros."""

    controlnet: ControlNetModel | MultiControlNetModel
    scales: Float[Array, "steps nets"]
    guess_mode: bool = eqx.field(static=True)

    def __call__(self, x, t, cond, *, step):
        nets = self.scales.shape[1]
        images = [cond[f"{CONTROL_IMAGE}_{i}"] for i in range(nets)]
        rest = {k: v for k, v in cond.items() if not k.startswith(CONTROL_IMAGE)}
        n = images[0].shape[0]
        guided = x.shape[0] == 2 * n
        half = guided and self.guess_mode  # the nets run on the positive half only
        pick = (lambda a: a[n:]) if half else (lambda a: a)
        if guided and not half:
            images = [jnp.concatenate([im, im]) for im in images]
        xc = pick(x)
        kwargs = {k: pick(rest[k]) for k in ("text_embeds", "time_ids") if k in rest}
        text = pick(rest["encoder_hidden_states"])
        image_tokens = ipa.image_token_count(self.unet)  # an IP-Adapter's, at the end: the nets read the text alone
        text = text[:, :text.shape[1] - image_tokens]
        args = (xc, jnp.broadcast_to(t, (xc.shape[0],)), text)
        down, mid = self.run_nets(args, images, self.scales[step], kwargs)
        if half:
            down = tuple(jnp.concatenate([jnp.zeros_like(d), d]) for d in down)
            mid = jnp.concatenate([jnp.zeros_like(mid), mid])
        return super().__call__(x, t, {**rest, "down_block_additional_residuals": down,
                                       "mid_block_additional_residual": mid}, step=step)

    def run_nets(self, args, images, scale, kwargs):
        """The net(s) on ``args`` (latents, timesteps, text), their control ``images`` and this step's ``scale``
        (one per entry of the table's row); a ControlNet variant calls its nets its own way here."""
        if isinstance(self.controlnet, MultiControlNetModel):
            return self.controlnet(*args, images, conditioning_scale=scale, guess_mode=self.guess_mode, **kwargs)
        return self.controlnet(*args, images[0], conditioning_scale=scale[0], guess_mode=self.guess_mode, **kwargs)


# -- the pipelines ------------------------------------------------------------------------------------------------

CONTROLNET = Component("controlnet", "diffusers")


def _net_folder(i: int) -> str:
    return "controlnet" if i == 0 else f"controlnet_{i}"


class ControlNetPipelineMixin:
    """What the ControlNet pipelines add to an SD/SDXL pipeline (a mixin before it in the bases): the
    ``controlnet`` component (one net, or a list / :class:`MultiControlNetModel`, stored as diffusers stores it) and
    the denoiser running it. A call binds its :class:`ControlInput` to a shallow copy of the pipeline and runs the
    SD/SDXL call on it."""

    NET_CLASS: ClassVar[type] = ControlNetModel  # the nets this pipeline runs
    MULTI_CLASS: ClassVar[type] = MultiControlNetModel  # several of them (its name is model_index.json's)
    SCHEDULER_FIXES: ClassVar = {}  # diffusers' ControlNet pipelines take the scheduler config as it is
    CONTROL_LOWEST: ClassVar[float] = 0.0  # the lowest value of a float control image (ControlInput.lowest)
    _control: ControlInput | None = None

    def __init__(self, *, controlnet, **kwargs):
        super().__init__(controlnet=_controlnets(controlnet, self.NET_CLASS, self.MULTI_CLASS), **kwargs)

    @property
    def nets(self) -> tuple:
        c = self.controlnet
        return c.nets if isinstance(c, self.MULTI_CLASS) else (c,)

    @classmethod
    def component_classes(cls, component: Component) -> tuple[str, ...]:
        if component.name == CONTROLNET.name:
            return cls.NET_CLASS.__name__, cls.MULTI_CLASS.__name__
        return super().component_classes(component)

    @classmethod
    def load_component(cls, folder: Path, component: Component, entry, **load_kwargs):
        if component.name != CONTROLNET.name or entry[1] != cls.MULTI_CLASS.__name__:
            return super().load_component(folder, component, entry, **load_kwargs)
        nets, i = [], 0
        while (Path(folder) / _net_folder(i)).is_dir():
            nets.append(load(folder, _net_folder(i), **load_kwargs))
            i += 1
        if not nets:
            raise CheckpointError(f"model_index.json in {str(folder)!r} names a {entry[1]} but there is no "
                                  "controlnet folder")
        return cls.MULTI_CLASS(nets)

    def save_component(self, folder: Path, component: Component, value, *, dtype=None) -> list:
        if not isinstance(value, self.MULTI_CLASS):
            return super().save_component(folder, component, value, dtype=dtype)
        for i, net in enumerate(value.nets):
            save_pretrained(net, Path(folder) / _net_folder(i), dtype=dtype)
        return ["diffusers", self.MULTI_CLASS.__name__]

    def _with_control(self, image, prompt, passed: dict, *, scale, start, end, guess_mode):
        control = control_input(self.controlnet, image, scale=scale, start=start, end=end, guess_mode=guess_mode)
        return self.bound(control, prompt, passed)

    def bound(self, control: ControlInput, prompt, passed: dict, **call_inputs):
        """This pipeline holding one call's ``control`` inputs (and a variant's own ``call_inputs``, set as
        attributes), which :meth:`denoiser` reads inside the family's call. ``prompt`` and ``passed`` (the keywords
        the call passes on to its family's call) give the inputs their prompt count and ``num_images_per_prompt``;
        their lowest value is the class's ``CONTROL_LOWEST``. A shallow copy, not a pipeline built through
        ``__init__``: for the length of one call it shares every component, their placement and
        :attr:`~eqxdiff.pipelines.DiffusionPipeline.timings` with this one, and nothing is placed again. Each control
        image's form, values and channels are checked here, before the call encodes anything, on the arrays the call
        then takes (:attr:`ControlInput.arrays`: each image prepared once)."""
        arrays = tuple(prepare_control_image(image, multiple=1, lowest=self.CONTROL_LOWEST) for image in control.images)
        control = dataclasses.replace(control, num_images_per_prompt=_images_per_prompt(passed),
                                      lowest=self.CONTROL_LOWEST, prompts=_call_prompts(prompt, passed), arrays=arrays)
        bound = copy.copy(self)
        bound._control = control
        for name, value in call_inputs.items():
            setattr(bound, name, value)
        bound.check_control_channels(arr.shape[-1] for arr in arrays)
        for i, arr in enumerate(arrays):  # per_output's count, before the prompts are encoded
            if control.prompts is not None and len(arr) not in (1, control.prompts):
                raise InputError(f"control image {i}: got {len(arr)} images for {control.prompts} prompts; pass one "
                                 "image or one per prompt")
        return bound

    def check_control_channels(self, channels) -> None:
        """Each control image's ``channels`` (in the call's order) are what its net reads."""
        for i, (net, c) in enumerate(zip(self.image_nets(), channels)):
            if c != net.config.conditioning_channels:
                raise InputError(f"control image {i} has {c} channels; its ControlNet takes "
                                 f"{net.config.conditioning_channels} (conditioning_channels)")

    def denoiser(self, cond: dict, *, guidance, schedule, batch: int, height: int, width: int):
        control = self._control
        if control is None:
            raise TypeError(f"{type(self).__name__}.generate runs inside a call of the pipeline (it needs the call's "
                            "control images)")
        images = control.prepared(batch=batch, height=height, width=width, multiple=self.vae_scale_factor)
        self.check_control_channels(image.shape[-1] for image in images)
        # One row per step of the (padded) schedule, indexed by the scheduler's step index: a traced table, so new
        # scales, start / end fractions or step counts compile nothing.
        state = schedule.state
        length, total, begin = int(state.timesteps.shape[0]), int(state.num_timesteps), int(state.begin_index)
        table = np.zeros((length, len(images)), np.float32)
        table[begin:total] = control_scales(control.scales, control.starts, control.ends, total - begin)
        cond = {**cond, **{f"{CONTROL_IMAGE}_{i}": jnp.asarray(im) for i, im in enumerate(images)}}
        return self.make_denoiser(jnp.asarray(table)), cond

    def image_nets(self) -> tuple:
        """The net reading each of the call's control images (one image per net here)."""
        return self.nets

    def make_denoiser(self, scales) -> ControlNetDenoiser:
        """The loop's denoiser for this call, with its ``[steps, images]`` table of ``scales``."""
        return ControlNetDenoiser(self.unet, self.controlnet, scales, self._control.guess_mode)


def _call_prompts(prompt, kwargs: dict) -> int | None:
    """How many prompts a ControlNet call holds (:func:`~eqxdiff.pipelines._checks.prompt_count` of ``prompt`` and
    the ``prompt_embeds`` among the keywords it passes on), ``None`` if they do not say."""
    return prompt_count({"prompt": prompt, "prompt_embeds": kwargs.get("prompt_embeds")})


def _images_per_prompt(kwargs: dict) -> int:
    """A call's ``num_images_per_prompt`` among the keywords it passes on to its family's call (default 1)."""
    n = kwargs.get("num_images_per_prompt", 1)
    return n if isinstance(n, int) else 1
