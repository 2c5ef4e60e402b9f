"""SDXL with ControlNet-Union (diffusers' ``StableDiffusionXLControlNetUnionPipeline``): one union net reading
several control images, each of its own control mode (canny, depth, pose ... as the net was trained), or several
union nets (diffusers' ``MultiControlNetUnionModel``: ``controlnet``, ``controlnet_1`` ... in the folder) with one
image and mode each.

It is the SDXL pipeline with the ControlNet pipelines' machinery (:mod:`eqxdiff.pipelines._controlnet`) and a union
net: per control image (one net) or per net (several), a ``controlnet_conditioning_scale`` and a
``control_guidance_start`` / ``_end`` window, as diffusers. With one net and several images each image's scale weighs
its part of the fusion and the residuals are not scaled again (diffusers' rule), so outside an image's window the net
still runs on the others (and on none: the latents alone). The ``control_type`` one-hot of the modes is the same for
every sample of the batch.

``guess_mode`` with classifier-free guidance runs the nets on the prompted half of the batch only, as the other
ControlNet pipelines do (diffusers 0.42's union pipeline fails there: it repeats ``control_type`` for both halves).
The union's token attention mixes the samples of a batch (see :mod:`eqxdiff.models.controlnet_union`), so the
guided batch runs as one (``Guidance(mode="batched")``), as diffusers runs it.

The image-to-image and inpainting classes (diffusers' ``StableDiffusionXLControlNetUnionImg2ImgPipeline`` and
``StableDiffusionXLControlNetUnionInpaintPipeline``) are the same nets on SDXL's image-to-image and inpainting
machinery, as :mod:`eqxdiff.pipelines.controlnet`'s SDXL image classes are; the differences from diffusers' calls
listed there hold for them too.

>>> pipe = eqxdiff.load_pipeline("path/to/sdxl-controlnet-union")
>>> images = pipe("a fox", control_image=[depth, pose], control_mode=[1, 0], num_inference_steps=30)
"""

from collections.abc import Sequence
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int
from ..models.controlnet_union import (
    ControlNetUnionModel,
    MultiControlNetUnionModel,
    control_type_vector,
)
from ._call import checked_call
from ._checks import InputError, InputTypeError
from ._components import Component
from ._controlnet import (
    CONTROLNET,
    ControlInput,
    ControlNetDenoiser,
    ControlNetPipelineMixin,
)
from .stable_diffusion_xl import (
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
)

__all__ = ["ControlNetUnionDenoiser", "StableDiffusionXLControlNetUnionImg2ImgPipeline",
           "StableDiffusionXLControlNetUnionInpaintPipeline", "StableDiffusionXLControlNetUnionPipeline"]


class ControlNetUnionDenoiser(ControlNetDenoiser):
    """:class:`~eqxdiff.pipelines.controlnet.ControlNetDenoiser` for union nets: ``modes`` holds each control
    image's mode and ``control_types`` each net's one-hot ``control_type`` (traced: a new mode reuses the compiled
    loop)."""

    controlnet: ControlNetUnionModel | MultiControlNetUnionModel
    modes: Int[Array, " images"]
    control_types: tuple[Float[Array, " num_control_type"], ...]

    def run_nets(self, args, images, scale, kwargs):
        batch = args[0].shape[0]
        types = [jnp.broadcast_to(t, (batch, t.shape[0])) for t in self.control_types]
        if isinstance(self.controlnet, MultiControlNetUnionModel):
            return self.controlnet(*args, [[im] for im in images], types,
                                   [self.modes[i:i + 1] for i in range(len(images))],
                                   conditioning_scale=[scale[i] for i in range(len(images))],
                                   guess_mode=self.guess_mode, **kwargs)
        return self.controlnet(*args, images, types[0], self.modes, conditioning_scale=scale,
                               guess_mode=self.guess_mode, **kwargs)


def _listed(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _per_entry(value, n: int, name: str, what: str) -> tuple:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * n
    if len(values) != n:
        raise InputError(f"{name} has {len(values)} entries for {n} {what}; give one value or one per {what[:-1]}")
    return values


class StableDiffusionXLControlNetUnionPipeline(ControlNetPipelineMixin, StableDiffusionXLPipeline):
    """SDXL with ControlNet-Union net(s) (see the module docstring). ``control_image``: the control image(s), a
    list for several; ``control_mode``: each image's control mode (an int, or a list in the images' order). The
    output size defaults to the first control image's. The other arguments are
    :class:`~eqxdiff.pipelines.StableDiffusionXLPipeline`'s (``guidance_rescale`` too, which diffusers' union pipeline
    does not take)."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionXLControlNetUnionPipeline"
    COMPONENTS: ClassVar[tuple[Component, ...]] = (*StableDiffusionXLPipeline.COMPONENTS, CONTROLNET)
    NET_CLASS: ClassVar[type] = ControlNetUnionModel
    MULTI_CLASS: ClassVar[type] = MultiControlNetUnionModel
    INIT_IMAGE: ClassVar[str | None] = None  # text-to-image only: the control images go to control_image
    _modes: tuple[int, ...] = ()

    @checked_call
    def __call__(self, prompt=None, prompt_2=None, control_image=None, *,
                 control_mode: int | Sequence[int] | None = None,
                 controlnet_conditioning_scale: float | Sequence[float] = 1.0,
                 control_guidance_start: float | Sequence[float] = 0.0,
                 control_guidance_end: float | Sequence[float] = 1.0, guess_mode: bool = False, height=None,
                 width=None, **kwargs):
        """Images for ``prompt`` steered by ``control_image`` of ``control_mode`` (see the class docstring).

        ``controlnet_conditioning_scale``, ``control_guidance_start`` / ``control_guidance_end``: one value, or one
        per control image (one net) or per net (several). ``guess_mode``: the nets see no prompt (the prompted half
        of a guided batch; forced by a net with ``global_pool_conditions``)."""
        for name in ("image", "mask_image"):
            if kwargs.get(name) is not None:
                raise InputError(f"{type(self).__name__} is text-to-image (diffusers' takes no {name}=); the control "
                                 "images go to control_image=")
        bound = self._with_union_control(control_image, control_mode, prompt, kwargs,
                                         scale=controlnet_conditioning_scale, start=control_guidance_start,
                                         end=control_guidance_end, guess_mode=guess_mode)
        height, width = bound._control.size(height, width, self.vae_scale_factor)
        return StableDiffusionXLPipeline.__call__(bound, prompt, prompt_2, height=height, width=width, **kwargs)

    def _with_union_control(self, image, mode, prompt, passed: dict, *, scale, start, end, guess_mode):
        """The call's control inputs checked as diffusers' ``check_inputs`` checks them, bound to a shallow copy of
        the pipeline (:meth:`bound`, with the call's ``prompt`` and ``passed`` keywords): one entry per control
        image."""
        nets = self.nets
        if image is None:
            raise InputError(f"{type(self).__name__} needs control_image= (a control image, or a list of them)")
        if mode is None:
            raise InputError("control_mode= is required: the control mode of each control image (an int, or a list "
                             "in the images' order), e.g. the index of 'depth' in the net's control types")
        images, modes = _listed(image), _listed(mode)
        if not images:
            raise InputError("control_image is an empty list; pass a control image (or a list of them) with its "
                             "control_mode")
        if any(isinstance(m, bool) or not isinstance(m, (int, np.integer)) for m in modes):
            raise InputTypeError(f"control_mode={mode!r:.60} must be ints: each control image's index in the net's "
                                 "control types (e.g. 1 for 'depth' in xinsir's union nets)")
        modes = [int(m) for m in modes]
        if len(images) != len(modes):
            raise InputError(f"{len(images)} control image(s) and {len(modes)} control_mode(s) given; give one "
                             "control mode per control image, in the same order")
        if len(nets) > 1 and len(images) != len(nets):
            raise InputError(f"{len(nets)} ControlNet-Union nets take one control image and one control_mode each; "
                             f"got {len(images)}")
        for i, m in enumerate(modes):
            k = nets[i if len(nets) > 1 else 0].config.num_control_type
            if not 0 <= m < k:
                raise InputError(f"control_mode {m} is out of range: this ControlNet-Union knows {k} control modes, "
                                 f"0 to {k - 1}")
        what = "nets" if len(nets) > 1 else "control images"
        scales = tuple(float(s) for s in _per_entry(scale, len(images), "controlnet_conditioning_scale", what))
        starts = _per_entry(start, len(images), "control_guidance_start", what)
        ends = _per_entry(end, len(images), "control_guidance_end", what)
        for s, e in zip(starts, ends):
            if not 0.0 <= s < e <= 1.0:
                raise InputError(f"control_guidance_start={s} and control_guidance_end={e} must satisfy 0 <= start < "
                                 "end <= 1")
        guess = bool(guess_mode) or nets[0].config.global_pool_conditions  # diffusers: the first net's
        return self.bound(ControlInput(tuple(images), scales, tuple(map(float, starts)), tuple(map(float, ends)),
                                       guess), prompt, passed, _modes=tuple(modes))

    def image_nets(self) -> tuple:
        nets = self.nets
        return nets if len(nets) > 1 else nets * len(self._modes)

    def make_denoiser(self, scales) -> ControlNetUnionDenoiser:
        nets, modes = self.nets, self._modes
        if len(nets) > 1:
            types = tuple(control_type_vector([m], n.config.num_control_type) for n, m in zip(nets, modes))
        else:
            types = (control_type_vector(modes, nets[0].config.num_control_type),)
        return ControlNetUnionDenoiser(self.unet, self.controlnet, scales, self._control.guess_mode,
                                       jnp.asarray(modes, jnp.int32), types)


class StableDiffusionXLControlNetUnionImg2ImgPipeline(StableDiffusionXLControlNetUnionPipeline):
    """SDXL image-to-image with ControlNet-Union net(s) (diffusers'
    ``StableDiffusionXLControlNetUnionImg2ImgPipeline``): ``image`` is the picture to start from, ``control_image`` /
    ``control_mode`` as the text-to-image class's (the images resized to the picture's size); ``strength`` and
    ``controlnet_conditioning_scale`` default to 0.8, as there. The micro-conditioning is
    :class:`~eqxdiff.pipelines.StableDiffusionXLImg2ImgPipeline`'s (``requires_aesthetics_score``: the aesthetic
    scores instead of the target size). ``guidance_rescale`` applies here, where diffusers' call swallows it in its
    ``**kwargs`` (match it with 0)."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionXLControlNetUnionImg2ImgPipeline"
    OPTIONS: ClassVar = StableDiffusionXLImg2ImgPipeline.OPTIONS
    IMAGE_TO_IMAGE_IDS: ClassVar[bool] = True
    INIT_IMAGE: ClassVar[str | None] = "image"  # the picture to start from; control_image the control images
    REQUIRED_INPUTS: ClassVar = ("image",)
    DEFAULT_STRENGTH: ClassVar = (0.8, 0.9999)

    @checked_call
    def __call__(self, prompt=None, prompt_2=None, image=None, control_image=None, *,
                 control_mode: int | Sequence[int] | None = None,
                 controlnet_conditioning_scale: float | Sequence[float] = 0.8,
                 control_guidance_start: float | Sequence[float] = 0.0,
                 control_guidance_end: float | Sequence[float] = 1.0, guess_mode: bool = False, **kwargs):
        self.check_inputs(image=image)
        bound = self._with_union_control(control_image, control_mode, prompt, kwargs,
                                         scale=controlnet_conditioning_scale, start=control_guidance_start,
                                         end=control_guidance_end, guess_mode=guess_mode)
        return StableDiffusionXLPipeline.__call__(bound, prompt, prompt_2, image=image, **kwargs)


class StableDiffusionXLControlNetUnionInpaintPipeline(StableDiffusionXLControlNetUnionPipeline):
    """SDXL inpainting with ControlNet-Union net(s) (diffusers' ``StableDiffusionXLControlNetUnionInpaintPipeline``):
    ``image`` the picture, ``mask_image`` the mask (white = repaint), ``control_image`` / ``control_mode`` as the
    text-to-image class's (resized to the picture's size, not masked by the pipeline). An ordinary (4-channel) UNet
    alone, the known region blended back after each step, as there (whose call refuses an inpainting UNet); the
    micro-conditioning and ``denoising_start`` / ``denoising_end`` of
    :class:`~eqxdiff.pipelines.StableDiffusionXLInpaintPipeline`, the negative ids being the positive ones (with
    ``negative_aesthetic_score``), as diffusers' ControlNet inpainting builds them. ``strength`` defaults to 0.9999,
    ``controlnet_conditioning_scale`` to 1.0 and ``guidance_scale`` to 5.0, as there (``guidance_rescale`` applies in
    both). ``padding_mask_crop`` is refused: diffusers' check refuses it for every call (it asks for one PIL
    control image after making the control images a list)."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionXLControlNetUnionInpaintPipeline"
    OPTIONS: ClassVar = StableDiffusionXLInpaintPipeline.OPTIONS
    IMAGE_TO_IMAGE_IDS: ClassVar[bool] = True
    NEGATIVE_TIME_IDS: ClassVar[bool] = False
    INIT_IMAGE: ClassVar[str | None] = "image"  # the picture to inpaint; control_image the control images
    REQUIRED_INPUTS: ClassVar = ("image", "mask_image")

    @checked_call
    def __call__(self, prompt=None, prompt_2=None, image=None, mask_image=None, control_image=None, *,
                 control_mode: int | Sequence[int] | None = None,
                 controlnet_conditioning_scale: float | Sequence[float] = 1.0,
                 control_guidance_start: float | Sequence[float] = 0.0,
                 control_guidance_end: float | Sequence[float] = 1.0, guess_mode: bool = False, **kwargs):
        self.check_inputs(image=image, mask_image=mask_image)
        if kwargs.get("padding_mask_crop") is not None:
            raise InputError(f"{type(self).__name__} takes no padding_mask_crop (diffusers' refuses it for any "
                             "call); crop the picture, mask and control images before the call")
        channels = self.unet.config.in_channels
        if channels != 4:
            raise InputError(f"{type(self).__name__} runs an ordinary 4-channel UNet, as diffusers' (the known region "
                             f"blended back); this UNet takes {channels} channels: load an SDXL base's UNet")
        bound = self._with_union_control(control_image, control_mode, prompt, kwargs,
                                         scale=controlnet_conditioning_scale, start=control_guidance_start,
                                         end=control_guidance_end, guess_mode=guess_mode)
        return StableDiffusionXLPipeline.__call__(bound, prompt, prompt_2, image=image, mask_image=mask_image,
                                                  **kwargs)
