"""ControlNet pipelines: Stable Diffusion 1.x/2.x and SDXL text-to-image, image-to-image and inpainting, with one
ControlNet or several (diffusers' ``MultiControlNetModel``: a pipeline folder's ``controlnet``, ``controlnet_1``, ...).

The SD and SDXL pipelines do the work; a ControlNet pipeline adds its ``controlnet`` component and, inside the
denoising loop, runs the net(s) before the UNet (:class:`ControlNetDenoiser`). Per net, as diffusers: a control
image (resized to the output size, values in ``[0, 1]``), ``controlnet_conditioning_scale``, and
``control_guidance_start`` / ``control_guidance_end`` (fractions of the steps outside which the net is off: a
``[steps, nets]`` table of scales computed on the host, indexed by the loop's step). ``guess_mode`` (forced by a
first net with ``global_pool_conditions``) runs the nets on the conditional half of a guided batch only, zeros for
the unconditional half.

``guidance_rescale`` (the family pipeline's) applies here too, where diffusers' ControlNet pipelines take none: SD's
text-to-image, image-to-image and inpainting and SDXL's text-to-image and image-to-image ``**kwargs`` swallow it
and they run without it, so match them with ``guidance_rescale=0`` (the default); SDXL inpainting applies it there.

Where diffusers' calls differ (fuzzed against diffusers 0.42.1): a control image of another size than the picture
(image-to-image, inpainting, no ``height`` / ``width``) fails there, its control image not resized (resized here),
unless no net runs (zero scales, windows leaving no step): SDXL image-to-image (the union's too) then runs with the
control image's size as the default ``original_size`` / ``target_size`` (the picture's here; equal given them);
``padding_mask_crop`` with several nets is refused there, its check taking the list of control images for the one
PIL image it wants (each image cropped here); SDXL image-to-image with ``int(num_inference_steps * strength) == 0``
runs no step there, unchecked, and returns an empty batch for one image (fails for more), where the schedule's
check refuses it here; SDXL inpainting given a base's handed-over latents as ``image`` (with ``denoising_start``)
fails there, its masked picture multiplying the latents by the pixel mask, and runs here as
:class:`~eqxdiff.pipelines.StableDiffusionXLInpaintPipeline` runs it (as diffusers' does): the run diffusers makes
from a picture whose VAE latents they are (``tests/test_handoff.py``); SDXL image-to-image (the union's too) stops at
``denoising_end`` and starts at ``denoising_start``, which diffusers' image-to-image ControlNet pipelines swallow in
their ``**kwargs`` (the whole schedule runs there: ``eqxdiff-generate`` refuses a ``--refiner`` after one).

Each class is its family's pipeline with nets: :class:`~eqxdiff.pipelines.StableDiffusionPipeline` or
:class:`~eqxdiff.pipelines.StableDiffusionXLPipeline` behind the shared
:class:`~eqxdiff.pipelines._controlnet.ControlNetPipelineMixin`. These subclass edges are the only imports between
family modules (declared in ``pyproject.toml``'s import contract).

>>> pipe = eqxdiff.load_pipeline("path/to/sd15-controlnet-canny")     # StableDiffusionControlNetPipeline
>>> images = pipe("a bird", image=edges, num_inference_steps=20)       # edges: uint8 [1, 512, 512, 3]
"""

from typing import ClassVar

from PIL import Image

from ._call import checked_call
from ._checks import InputError
from ._components import Component
from ._controlnet import (
    CONTROLNET,
    ControlInput,
    ControlNetDenoiser,
    ControlNetPipelineMixin,
    control_input,
    control_scales,
    prepare_control_image,
)
from ._mask_crop import crop_region, resize_and_fill
from .stable_diffusion import StableDiffusionPipeline
from .stable_diffusion_xl import (
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
)

__all__ = ["ControlInput", "ControlNetDenoiser", "StableDiffusionControlNetImg2ImgPipeline",
           "StableDiffusionControlNetInpaintPipeline", "StableDiffusionControlNetPipeline",
           "StableDiffusionXLControlNetImg2ImgPipeline", "StableDiffusionXLControlNetInpaintPipeline",
           "StableDiffusionXLControlNetPipeline", "control_input",
           "control_scales", "prepare_control_image"]


class StableDiffusionControlNetPipeline(ControlNetPipelineMixin, StableDiffusionPipeline):
    """Stable Diffusion 1.x/2.x with ControlNet(s) (diffusers' ``StableDiffusionControlNetPipeline``): ``image`` is
    the control image (one per net with several); the output size defaults to its size. The other arguments are
    :class:`~eqxdiff.pipelines.StableDiffusionPipeline`'s."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionControlNetPipeline"
    COMPONENTS: ClassVar[tuple[Component, ...]] = (*StableDiffusionPipeline.COMPONENTS, CONTROLNET)
    INIT_IMAGE: ClassVar[str | None] = None  # image is the control image (diffusers' name)
    DEFAULT_CONTROL_SCALE: ClassVar[float] = 1.0

    @checked_call
    def __call__(self, prompt=None, negative_prompt=None, image=None, *, controlnet_conditioning_scale=None,
                 control_guidance_start=0.0, control_guidance_end=1.0, guess_mode: bool = False, height=None,
                 width=None, **kwargs):
        bound = self._with_control(image, prompt, kwargs, scale=self._scale(controlnet_conditioning_scale),
                                   start=control_guidance_start, end=control_guidance_end, guess_mode=guess_mode)
        height, width = bound._control.size(height, width, self.vae_scale_factor)
        return StableDiffusionPipeline.__call__(bound, prompt, negative_prompt, height=height, width=width, **kwargs)

    def _scale(self, scale):
        return self.DEFAULT_CONTROL_SCALE if scale is None else scale


class StableDiffusionControlNetImg2ImgPipeline(StableDiffusionControlNetPipeline):
    """Image-to-image with ControlNet(s) (diffusers' ``StableDiffusionControlNetImg2ImgPipeline``): ``image`` is the
    picture to start from, ``control_image`` the control image(s), resized to the picture's size;
    ``controlnet_conditioning_scale`` defaults to 0.8 and ``strength`` to 0.8, as there."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionControlNetImg2ImgPipeline"
    INIT_IMAGE: ClassVar[str | None] = "image"  # the picture to start from; control_image the control image
    REQUIRED_INPUTS: ClassVar = ("image",)
    DEFAULT_CONTROL_SCALE: ClassVar[float] = 0.8

    @checked_call
    def __call__(self, prompt=None, negative_prompt=None, image=None, control_image=None, *,
                 controlnet_conditioning_scale=None, control_guidance_start=0.0, control_guidance_end=1.0,
                 guess_mode: bool = False, **kwargs):
        self.check_inputs(image=image)
        bound = self._with_control(control_image, prompt, kwargs, scale=self._scale(controlnet_conditioning_scale),
                                   start=control_guidance_start, end=control_guidance_end, guess_mode=guess_mode)
        return StableDiffusionPipeline.__call__(bound, prompt, negative_prompt, image=image, **kwargs)


class StableDiffusionControlNetInpaintPipeline(StableDiffusionControlNetPipeline):
    """Inpainting with ControlNet(s) (diffusers' ``StableDiffusionControlNetInpaintPipeline``): ``image`` the picture,
    ``mask_image`` the mask (white = repaint), ``control_image`` the control image(s), resized to the picture's size
    and, as there, not masked by the pipeline (an inpainting net's condition, diffusers' ``make_inpaint_condition``:
    floats with the masked pixels -1, is passed on as it is). A 9-channel inpainting UNet or an ordinary one, as
    :class:`~eqxdiff.pipelines.StableDiffusionInpaintPipeline`; ``strength`` defaults to 1.0 and
    ``controlnet_conditioning_scale`` to 0.5, as diffusers'. With ``padding_mask_crop`` (PIL picture, mask and
    control images) the control images are cut to the mask's box as the picture is, and the output size defaults to
    the picture's, as there."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionControlNetInpaintPipeline"
    INIT_IMAGE: ClassVar[str | None] = "image"  # the picture to inpaint; control_image the control image
    REQUIRED_INPUTS: ClassVar = ("image", "mask_image")
    CONTROL_LOWEST: ClassVar[float] = -1.0  # an inpainting net's condition: the picture, masked pixels -1
    DEFAULT_CONTROL_SCALE: ClassVar[float] = 0.5

    @checked_call
    def __call__(self, prompt=None, negative_prompt=None, image=None, mask_image=None, control_image=None, *,
                 controlnet_conditioning_scale=None, control_guidance_start=0.0, control_guidance_end=1.0,
                 guess_mode: bool = False, padding_mask_crop=None, **kwargs):
        self.check_inputs(image=image, mask_image=mask_image)
        if padding_mask_crop is not None:
            control_image, kwargs = _cropped_control(self, control_image, image, mask_image, padding_mask_crop, kwargs)
        bound = self._with_control(control_image, prompt, kwargs, scale=self._scale(controlnet_conditioning_scale),
                                   start=control_guidance_start, end=control_guidance_end, guess_mode=guess_mode)
        return StableDiffusionPipeline.__call__(bound, prompt, negative_prompt, image=image, mask_image=mask_image,
                                                padding_mask_crop=padding_mask_crop, **kwargs)


class StableDiffusionXLControlNetPipeline(ControlNetPipelineMixin, StableDiffusionXLPipeline):
    """SDXL with ControlNet(s) (diffusers' ``StableDiffusionXLControlNetPipeline``): ``image`` is the control image
    (one per net with several); the output size defaults to its size. The other arguments are
    :class:`~eqxdiff.pipelines.StableDiffusionXLPipeline`'s."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionXLControlNetPipeline"
    COMPONENTS: ClassVar[tuple[Component, ...]] = (*StableDiffusionXLPipeline.COMPONENTS, CONTROLNET)
    INIT_IMAGE: ClassVar[str | None] = None  # image is the control image (diffusers' name)

    @checked_call
    def __call__(self, prompt=None, prompt_2=None, image=None, *, controlnet_conditioning_scale=1.0,
                 control_guidance_start=0.0, control_guidance_end=1.0, guess_mode: bool = False, height=None,
                 width=None, **kwargs):
        bound = self._with_control(image, prompt, kwargs, scale=controlnet_conditioning_scale,
                                   start=control_guidance_start, end=control_guidance_end, guess_mode=guess_mode)
        height, width = bound._control.size(height, width, self.vae_scale_factor)
        return StableDiffusionXLPipeline.__call__(bound, prompt, prompt_2, height=height, width=width, **kwargs)


class StableDiffusionXLControlNetImg2ImgPipeline(StableDiffusionXLControlNetPipeline):
    """SDXL image-to-image with ControlNet(s) (diffusers' ``StableDiffusionXLControlNetImg2ImgPipeline``): ``image``
    is the picture to start from, ``control_image`` the control image(s), resized to the picture's size;
    ``controlnet_conditioning_scale`` and ``strength`` default to 0.8, as there. The micro-conditioning is
    :class:`~eqxdiff.pipelines.StableDiffusionXLImg2ImgPipeline`'s (``requires_aesthetics_score``: the aesthetic
    scores instead of the target size)."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionXLControlNetImg2ImgPipeline"
    OPTIONS: ClassVar = StableDiffusionXLImg2ImgPipeline.OPTIONS
    IMAGE_TO_IMAGE_IDS: ClassVar[bool] = True
    INIT_IMAGE: ClassVar[str | None] = "image"  # the picture to start from; control_image the control image
    REQUIRED_INPUTS: ClassVar = ("image",)
    DEFAULT_STRENGTH: ClassVar = (0.8, 0.9999)

    @checked_call
    def __call__(self, prompt=None, prompt_2=None, image=None, control_image=None, *,
                 controlnet_conditioning_scale=0.8, control_guidance_start=0.0, control_guidance_end=1.0,
                 guess_mode: bool = False, **kwargs):
        self.check_inputs(image=image)
        bound = self._with_control(control_image, prompt, kwargs, scale=controlnet_conditioning_scale,
                                   start=control_guidance_start, end=control_guidance_end, guess_mode=guess_mode)
        return StableDiffusionXLPipeline.__call__(bound, prompt, prompt_2, image=image, **kwargs)


class StableDiffusionXLControlNetInpaintPipeline(StableDiffusionXLControlNetPipeline):
    """SDXL inpainting with ControlNet(s) (diffusers' ``StableDiffusionXLControlNetInpaintPipeline``): ``image`` the
    picture, ``mask_image`` the mask (white = repaint), ``control_image`` the control image(s), resized to the
    picture's size and not masked by the pipeline, as there (float images may hold -1, as an inpainting net's
    condition). A 9-channel inpainting UNet or an ordinary one, the
    micro-conditioning and ``denoising_start`` / ``denoising_end`` of
    :class:`~eqxdiff.pipelines.StableDiffusionXLInpaintPipeline`; as diffusers', ``strength`` defaults to 0.9999,
    ``controlnet_conditioning_scale`` to 1.0 and ``guidance_scale`` to 5.0. ``padding_mask_crop`` as
    :class:`StableDiffusionControlNetInpaintPipeline`'s. The negative micro-conditioning is the positive one with
    ``negative_aesthetic_score``, as there (whose call takes no negative sizes or crop: refused here)."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionXLControlNetInpaintPipeline"
    OPTIONS: ClassVar = StableDiffusionXLInpaintPipeline.OPTIONS
    IMAGE_TO_IMAGE_IDS: ClassVar[bool] = True
    NEGATIVE_TIME_IDS: ClassVar[bool] = False  # diffusers' negative ids: the positive sizes and crop
    INIT_IMAGE: ClassVar[str | None] = "image"  # the picture to inpaint; control_image the control image
    REQUIRED_INPUTS: ClassVar = ("image", "mask_image")
    CONTROL_LOWEST: ClassVar[float] = -1.0  # an inpainting net's condition: the picture, masked pixels -1
    DEFAULT_GUIDANCE: ClassVar[float] = 5.0

    @checked_call
    def __call__(self, prompt=None, prompt_2=None, image=None, mask_image=None, control_image=None, *,
                 controlnet_conditioning_scale=1.0, control_guidance_start=0.0, control_guidance_end=1.0,
                 guess_mode: bool = False, padding_mask_crop=None, **kwargs):
        self.check_inputs(image=image, mask_image=mask_image)
        if padding_mask_crop is not None:
            control_image, kwargs = _cropped_control(self, control_image, image, mask_image, padding_mask_crop, kwargs)
        bound = self._with_control(control_image, prompt, kwargs, scale=controlnet_conditioning_scale,
                                   start=control_guidance_start, end=control_guidance_end, guess_mode=guess_mode)
        return StableDiffusionXLPipeline.__call__(bound, prompt, prompt_2, image=image, mask_image=mask_image,
                                                  padding_mask_crop=padding_mask_crop, **kwargs)


def _cropped_control(pipe, control_image, image, mask_image, padding_mask_crop: int, kwargs: dict):
    """diffusers' ``padding_mask_crop`` for the control images of an inpainting call: each (a PIL image, as diffusers
    asks) cut to the box around the mask and fitted to the output size, as the picture is
    (:func:`~eqxdiff.pipelines._mask_crop.mask_cropped` does that one); the output size defaults to the picture's
    (rounded down to the VAE's factor). Returns the control images and the call's keywords with that size."""
    several = isinstance(control_image, (list, tuple))
    images = list(control_image) if several else [control_image]
    if not all(isinstance(im, Image.Image) for im in [image, mask_image, *images]):
        raise InputError("padding_mask_crop needs image=, mask_image= and control_image= as PIL images (as diffusers; "
                         "one per net): Image.fromarray(array) makes one")
    f = pipe.vae_scale_factor
    height = kwargs.get("height") or image.height - image.height % f
    width = kwargs.get("width") or image.width - image.width % f
    box = crop_region(mask_image, width, height, padding_mask_crop)
    cropped = [resize_and_fill(im.convert("RGB").crop(box), width, height) for im in images]
    return (cropped if several else cropped[0]), {**kwargs, "height": height, "width": width}
