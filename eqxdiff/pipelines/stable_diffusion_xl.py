"""Stable Diffusion XL: text-to-image, image-to-image, the refiner and its hand-off, inpainting.

Two CLIP text encoders: each gives its penultimate hidden states (``clip_skip`` goes further back), concatenated
on the feature axis; the pooled, projected output of ``text_encoder_2`` and the micro-conditioning ``time_ids``
(``original_size + crops_coords_top_left + target_size``, or ``+ aesthetic_score`` for the refiner) go to the
UNet's ``text_time`` embedding. A refiner folder has no first encoder.

>>> base = eqxdiff.load_pipeline("stabilityai/stable-diffusion-xl-base-1.0")
>>> refiner = eqxdiff.load_pipeline("stabilityai/stable-diffusion-xl-refiner-1.0")
>>> latents = base("a fox", num_inference_steps=40, denoising_end=0.8, output_type="latent")
>>> images = refiner("a fox", image=latents, num_inference_steps=40, denoising_start=0.8)

Few-step distilled UNets run as their authors do: SDXL-Lightning with
``base.with_scheduler("euler", timestep_spacing="trailing")`` and ``guidance_scale=0`` (the 1-step x0 UNet also
with ``prediction_type="sample"``).
"""

from collections.abc import Sequence
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray
from ..core import program
from ._arguments import as_list, given_array, prompt_list, resolve_key
from ._call import checked_call
from ._checks import InputError
from ._components import Component
from ._denoise import Guidance
from ._mask_crop import mask_cropped
from ._text import tokenize
from ._unet import UNetPipeline

__all__ = ["StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline", "StableDiffusionXLPipeline",
           "encode_prompt", "time_ids"]

Size = tuple[int, int]


@program
def encode_prompt(text_encoder, input_ids: Int[Array, "batch seq"], *, layer: int = -2
                  ) -> tuple[Float[Array, "batch seq embed"], Float[Array, "batch proj"] | None]:
    """One SDXL text encoder: its hidden states ``layer`` (``-2``: the penultimate layer's output, without the
    final layer norm; ``clip_skip=k`` is ``-(k + 2)``), and its pooled projection (``text_embeds``; ``None`` for an
    encoder without projection)."""
    out = text_encoder(input_ids, output_hidden_states=True)
    return out.hidden_states[layer], out.text_embeds


def time_ids(original_size: Size, crops_coords_top_left: Size, last: Size | tuple[float]) -> np.ndarray:
    """SDXL's micro-conditioning: ``original_size + crops_coords_top_left + target_size`` (6 numbers), or with an
    aesthetic score in place of the target size (5 numbers, the refiner)."""
    return np.asarray([*original_size, *crops_coords_top_left, *last], np.float32)


class StableDiffusionXLPipeline(UNetPipeline):
    """SDXL text-to-image (and image-to-image / inpainting with ``image`` / ``mask_image``, under the
    text-to-image micro-conditioning; the Img2Img and Inpaint classes follow diffusers' for those tasks).

    Returns uint8 images ``[n, height, width, 3]`` (``output_type``: ``"np"`` floats, ``"pil"`` images), or
    with ``output_type="latent"`` the final latents channels-last (a refiner's ``image``).
    ``force_zeros_for_empty_prompt`` (``model_index.json``; default true):
    without a ``negative_prompt`` the negative embeddings are zeros rather than the encoded empty prompt.
    """

    CLASS_NAME: ClassVar[str] = "StableDiffusionXLPipeline"
    LATENT_NORM: ClassVar[str] = "mean_std"  # diffusers' SDXL: latents_mean / latents_std if set, no shift_factor
    LORA_FORMAT: ClassVar[str] = "eqxdiff.pipelines._lora_unet:SDXL"
    LORA_SCALE_ARGUMENT: ClassVar[str | None] = "cross_attention_kwargs"  # {"scale": s} (diffusers)
    COMPONENTS: ClassVar[tuple[Component, ...]] = (
        Component("tokenizer", "transformers", "tokenizer", optional=True),
        Component("tokenizer_2", "transformers", "tokenizer"),
        Component("text_encoder", "transformers", classes=("CLIPTextModel",), optional=True, encoder=True),
        Component("text_encoder_2", "transformers", classes=("CLIPTextModelWithProjection",), encoder=True),
        Component("unet", "diffusers", classes=("UNet2DConditionModel",)),
        Component("vae", "diffusers", classes=("AutoencoderKL",), scan=False),
        Component("scheduler", "diffusers", "scheduler"),
    )
    INDEX_EXTRAS: ClassVar = {"image_encoder": [None, None], "feature_extractor": [None, None]}
    OPTIONS: ClassVar = {"force_zeros_for_empty_prompt": True}
    DEFAULT_STRENGTH: ClassVar = (0.3, 0.9999)
    DEFAULT_GUIDANCE: ClassVar[float] = 5.0
    CLIP_SKIP_OFFSET: ClassVar[int] = 1  # the penultimate layer by default
    TEXTUAL_INVERSION_FILE_KEYS: ClassVar = {"clip_l": ("tokenizer", "text_encoder"),
                                             "clip_g": ("tokenizer_2", "text_encoder_2")}
    # The image-to-image classes' micro-conditioning (negative sizes default to the positive ones; the aesthetic
    # score with requires_aesthetics_score).
    IMAGE_TO_IMAGE_IDS: ClassVar[bool] = False
    # False: the negative micro-conditioning is the positive one (sizes and crop) with the negative aesthetic score,
    # and negative_original_size / _crops_coords_top_left / _target_size are refused (diffusers' ControlNet
    # inpainting pipelines: their calls take none, **kwargs swallows them).
    NEGATIVE_TIME_IDS: ClassVar[bool] = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if (self.tokenizer is None) != (self.text_encoder is None):
            raise TypeError(f"{type(self).__name__}: give tokenizer and text_encoder together (or neither, as a "
                            "refiner does)")
        config = self.unet.config
        if config.addition_embed_type != "text_time":
            raise TypeError(f"{type(self).__name__}: the UNet has addition_embed_type="
                            f"{config.addition_embed_type!r}; SDXL pipelines need 'text_time' (pooled text and size "
                            "conditioning)")

    # -- text conditioning ---------------------------------------------------------------------------------------

    def _encoders(self) -> list[tuple[str, str]]:
        pairs = [("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")]
        return [p for p in pairs if getattr(self, p[1]) is not None]

    def encode(self, prompts: Sequence[str], prompts_2: Sequence[str], *, layer: int = -2):
        """``(embeddings [n, seq, sum of hidden sizes], pooled [n, projection])``: each encoder's hidden states
        ``layer`` concatenated, the pooled output of ``text_encoder_2``."""
        states, pooled = [], None
        # As diffusers zips [prompts, prompts_2] with the encoders present: a refiner's one encoder gets prompts.
        for (tokenizer, encoder), texts in zip(self._encoders(), [prompts, prompts_2]):
            texts = self.maybe_convert_prompt(texts, getattr(self, tokenizer))
            ids = tokenize(getattr(self, tokenizer), texts, vocab_size=getattr(self, encoder).config.vocab_size)
            ids = self.shard(jnp.asarray(ids))
            hidden, pooled = encode_prompt(self.encoder(encoder), ids, layer=layer)
            states.append(hidden)
        if pooled is None:
            raise TypeError("text_encoder_2 has no text projection; SDXL needs a CLIPTextModelWithProjection")
        return jnp.concatenate(states, axis=-1), pooled

    def text_conditioning(self, prompt=None, prompt_2=None, negative_prompt=None, negative_prompt_2=None, *,
                          guidance: Guidance, clip_skip: int | None = None, prompt_embeds=None,
                          negative_prompt_embeds=None, pooled_prompt_embeds=None,
                          negative_pooled_prompt_embeds=None):
        """``(embeddings, pooled)``, ``[negative; positive]`` along the batch with guidance, as diffusers'
        ``encode_prompt``: ``prompt_2`` / ``negative_prompt_2`` go to ``text_encoder_2`` (default: the first
        ones); without a negative prompt and with ``force_zeros_for_empty_prompt`` the negatives are zeros. As in
        diffusers, negative prompts take the penultimate layer whatever ``clip_skip``."""
        if prompt_embeds is None:
            if prompt is None:
                raise ValueError("pass prompt or prompt_embeds (with pooled_prompt_embeds)")
            prompts = prompt_list(prompt)
            # diffusers: `prompt_2 or prompt` (an empty string is no second prompt)
            prompts_2 = prompts if not prompt_2 else as_list(prompt_2, len(prompts), "prompt_2")
            embeds, pooled = self.encode(prompts, prompts_2, layer=-(clip_skip or 0) - 2)
        else:
            if prompt is not None or prompt_2 is not None:
                raise ValueError("pass prompt (and prompt_2) or prompt_embeds, not both")
            embeds = jnp.asarray(prompt_embeds, jnp.float32)
            if embeds.ndim != 3:
                raise ValueError(f"prompt_embeds must be [n, seq, embed], got shape {embeds.shape}")
            if pooled_prompt_embeds is None:
                raise ValueError("prompt_embeds needs pooled_prompt_embeds (text_encoder_2's pooled projection)")
            pooled = jnp.asarray(pooled_prompt_embeds, jnp.float32)
            if pooled.ndim != 2 or pooled.shape[0] != embeds.shape[0]:
                raise ValueError(f"pooled_prompt_embeds must be [{embeds.shape[0]}, projection], got shape "
                                 f"{pooled.shape}")
        if not guidance.enabled:
            return embeds, pooled
        n = embeds.shape[0]
        if negative_prompt_embeds is not None:
            if negative_pooled_prompt_embeds is None:
                raise ValueError("negative_prompt_embeds needs negative_pooled_prompt_embeds")
            negative = given_array(negative_prompt_embeds, embeds.shape, "negative_prompt_embeds",
                                   "prompt_embeds' shape [n, seq, embed]")
            negative_pooled = given_array(negative_pooled_prompt_embeds, pooled.shape,
                                          "negative_pooled_prompt_embeds", "pooled_prompt_embeds' shape")
        elif negative_prompt is None and self.force_zeros_for_empty_prompt:
            negative, negative_pooled = jnp.zeros_like(embeds), jnp.zeros_like(pooled)
        else:
            negatives = as_list("" if negative_prompt is None else negative_prompt, n, "negative_prompt")
            negatives_2 = negatives if not negative_prompt_2 else as_list(negative_prompt_2, n, "negative_prompt_2")
            negative, negative_pooled = self.encode(negatives, negatives_2)
        return jnp.concatenate([negative, embeds]), jnp.concatenate([negative_pooled, pooled])

    # -- micro-conditioning --------------------------------------------------------------------------------------

    def add_time_ids(self, *, height: int, width: int, original_size: Size | None = None,
                     crops_coords_top_left: Size = (0, 0), target_size: Size | None = None,
                     negative_original_size: Size | None = None, negative_crops_coords_top_left: Size = (0, 0),
                     negative_target_size: Size | None = None, aesthetic_score: float = 6.0,
                     negative_aesthetic_score: float = 2.5, pooled_dim: int) -> tuple[np.ndarray, np.ndarray]:
        """``(positive, negative)`` time ids as diffusers' SDXL pipelines build them (sizes default to the
        output's), checked against the UNet's ``projection_class_embeddings_input_dim``. Each row of the batch
        gets its half's ids (diffusers' text-to-image pipeline tiles ``[negative, positive]`` over a batch > 1,
        giving some rows the other half's ids when they differ; its image-to-image pipeline pairs them as here,
        diffusers#4327)."""
        original_size = tuple(original_size or (height, width))
        target_size = tuple(target_size or (height, width))
        if not self.NEGATIVE_TIME_IDS:  # (the call refused negative ones: check_negative_time_ids)
            negative_original_size, negative_target_size = original_size, target_size
            negative_crops_coords_top_left = crops_coords_top_left
        if self.IMAGE_TO_IMAGE_IDS:
            negative_original_size = tuple(negative_original_size or original_size)
            negative_target_size = tuple(negative_target_size or target_size)
            if self.requires_aesthetics_score:
                positive = time_ids(original_size, crops_coords_top_left, (aesthetic_score,))
                negative = time_ids(negative_original_size, negative_crops_coords_top_left,
                                    (negative_aesthetic_score,))
            else:  # diffusers pairs the negative sizes with the positive crop here
                positive = time_ids(original_size, crops_coords_top_left, target_size)
                negative = time_ids(negative_original_size, crops_coords_top_left, negative_target_size)
        else:
            positive = time_ids(original_size, crops_coords_top_left, target_size)
            negative = positive
            if negative_original_size is not None and negative_target_size is not None:
                negative = time_ids(negative_original_size, negative_crops_coords_top_left, negative_target_size)
        config = self.unet.config
        expected, got = config.projection_class_embeddings_input_dim, config.addition_time_embed_dim * len(positive)
        if expected != got + pooled_dim:
            extra = (got + pooled_dim - expected) // config.addition_time_embed_dim
            hint = ("the UNet wants an aesthetic score in place of the target size: use "
                    "StableDiffusionXLImg2ImgPipeline with requires_aesthetics_score=True" if extra == 1 and
                    (got + pooled_dim - expected) % config.addition_time_embed_dim == 0 else
                    "the UNet wants the target size, not an aesthetic score: set requires_aesthetics_score=False"
                    if extra == -1 and (expected - got - pooled_dim) % config.addition_time_embed_dim == 0 else
                    "check the UNet's addition_time_embed_dim and text_encoder_2's projection_dim")
            raise ValueError(f"the UNet's projection_class_embeddings_input_dim={expected}, but {len(positive)} time "
                             f"ids x {config.addition_time_embed_dim} + pooled {pooled_dim} = {got + pooled_dim}; "
                             f"{hint}")
        return positive, negative

    def check_negative_time_ids(self, original_size, crops_coords_top_left, target_size) -> None:
        """Refuse negative micro-conditioning where the pipeline takes none (``NEGATIVE_TIME_IDS`` false)."""
        given = [name for name, value in (("negative_original_size", original_size),
                                          ("negative_crops_coords_top_left", crops_coords_top_left),
                                          ("negative_target_size", target_size))
                 if value is not None and not (name.startswith("negative_crops") and tuple(value) == (0, 0))]
        if given and not self.NEGATIVE_TIME_IDS:
            raise InputError(f"{type(self).__name__} takes no {', '.join(given)}: as diffusers', its negative "
                             "micro-conditioning is the positive one (negative_aesthetic_score aside)")

    # -- the call ------------------------------------------------------------------------------------------------

    @checked_call
    @mask_cropped
    def __call__(self, prompt: str | Sequence[str] | None = None, prompt_2: str | Sequence[str] | None = None, *,
                 negative_prompt: str | Sequence[str] | None = None,
                 negative_prompt_2: str | Sequence[str] | None = None, num_inference_steps: int = 50,
                 guidance_scale: float | None = None, guidance_rescale: float = 0.0, height: int | None = None,
                 width: int | None = None, num_images_per_prompt: int = 1, latents=None, image=None,
                 mask_image=None, strength: float | None = None, denoising_start: float | None = None,
                 denoising_end: float | None = None, eta: float = 0.0, timesteps: Sequence[int] | None = None,
                 sigmas: Sequence[float] | None = None, seed: int | None = None, key: PRNGKeyArray | None = None,
                 clip_skip: int | None = None, prompt_embeds=None, negative_prompt_embeds=None,
                 pooled_prompt_embeds=None, negative_pooled_prompt_embeds=None, original_size: Size | None = None,
                 crops_coords_top_left: Size = (0, 0), target_size: Size | None = None,
                 negative_original_size: Size | None = None, negative_crops_coords_top_left: Size = (0, 0),
                 negative_target_size: Size | None = None, aesthetic_score: float = 6.0,
                 negative_aesthetic_score: float = 2.5, masked_image_latents=None, padding_mask_crop: int | None = None,
                 ip_adapter_image=None, ip_adapter_image_embeds=None, ip_adapter_masks=None,
                 output_type: str = "uint8", progress: bool = True):
        """Images for ``prompt`` with diffusers' SDXL arguments: uint8 ``[n, height, width, 3]``, or the final
        latents channels-last with ``output_type="latent"``.

        Args:
            prompt: What to generate (both encoders' prompt unless ``prompt_2`` is given).
            prompt_2: The second text encoder's prompt (default: ``prompt``).
            negative_prompt: What to steer away from; without it and with ``force_zeros_for_empty_prompt`` the
                negative conditioning is zeros.
            negative_prompt_2: The second text encoder's negative prompt (default: ``negative_prompt``).
            guidance_scale: Classifier-free guidance scale (default 5, 7.5 for inpainting); <= 1 turns it off.
            latents: The initial noise ``[n, height/8, width/8, 4]``, channels-last (an array).
            image: Image-to-image or inpainting input: pixels (uint8 ``[n, H, W, 3]``, PIL, floats in [0, 1]) or
                latents ``[n, h, w, 4]`` handed over by a base pipeline's ``output_type="latent"``.
            mask_image: Inpainting mask (white = repaint), the image's size.
            strength: How much of the schedule an image-to-image / inpainting run takes (default 0.3 / 0.9999).
            denoising_start: Refiner hand-off: start at this fraction of the schedule from ``image``'s latents.
            denoising_end: Stop at this fraction of the schedule (with ``output_type="latent"``, for a refiner).
            eta: Noise of the DDIM / TCD steps.
            timesteps: A custom descending timestep schedule (replaces ``num_inference_steps``).
            sigmas: A custom noise-level schedule (replaces ``num_inference_steps``).
            original_size: Micro-conditioning: the training image's size (default: the output's).
            crops_coords_top_left: Micro-conditioning: the crop's top-left corner.
            target_size: Micro-conditioning: the target size (default: the output's).
            negative_original_size: The negative conditioning's ``original_size``.
            negative_crops_coords_top_left: The negative conditioning's crop corner.
            negative_target_size: The negative conditioning's ``target_size``.
            aesthetic_score: The refiner's aesthetic score (with ``requires_aesthetics_score``).
            negative_aesthetic_score: The refiner's negative aesthetic score.
            ip_adapter_image: The image prompt of the loaded IP-Adapter(s), one entry per adapter, each an image or a
                list of images (see :class:`~eqxdiff.pipelines.StableDiffusionPipeline`); ``ip_adapter_image_embeds``
                their CLIP image embeddings instead; ``ip_adapter_masks`` where each adapter's images act.
            output_type: ``"uint8"`` images, ``"np"`` (float32 in [0, 1]), ``"pil"`` (a list of PIL
                images) or ``"latent"`` (channels-last latents).
        """
        self.check_inputs(image=image, mask_image=mask_image)
        self.check_negative_time_ids(negative_original_size, negative_crops_coords_top_left, negative_target_size)
        key = resolve_key(seed, key)
        scale = self.DEFAULT_GUIDANCE if guidance_scale is None else float(guidance_scale)
        guidance = self.guidance(scale, guidance_rescale)
        with self.timed("encode"):
            embeds, pooled = self.text_conditioning(
                prompt, prompt_2, negative_prompt, negative_prompt_2, guidance=guidance, clip_skip=clip_skip,
                prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                pooled_prompt_embeds=pooled_prompt_embeds, negative_pooled_prompt_embeds=negative_pooled_prompt_embeds)
            embeds = jnp.repeat(embeds, num_images_per_prompt, axis=0)
            pooled = jnp.repeat(pooled, num_images_per_prompt, axis=0)
            embeds, pipe = self.with_ip_adapter_tokens(embeds, ip_adapter_image, ip_adapter_image_embeds,
                                                       guidance.enabled, num_images_per_prompt=num_images_per_prompt)
        n, source, height, width, strength = self.image_inputs(embeds, guidance, image, mask_image, height, width,
                                                             strength)
        positive, negative = self.add_time_ids(
            height=height, width=width, original_size=original_size, crops_coords_top_left=crops_coords_top_left,
            target_size=target_size, negative_original_size=negative_original_size,
            negative_crops_coords_top_left=negative_crops_coords_top_left, negative_target_size=negative_target_size,
            aesthetic_score=aesthetic_score, negative_aesthetic_score=negative_aesthetic_score,
            pooled_dim=pooled.shape[-1])
        ids = np.stack([negative] * n + [positive] * n) if guidance.enabled else np.stack([positive] * n)
        cond = {"encoder_hidden_states": embeds, "text_embeds": pooled, "time_ids": jnp.asarray(ids)}
        return pipe.generate(cond, guidance=guidance, guidance_scale=scale, batch=n, height=height, width=width,
                             num_inference_steps=num_inference_steps, key=key, latents=latents, image=source,
                             mask_image=mask_image, strength=strength, denoising_start=denoising_start,
                             denoising_end=denoising_end, eta=eta, schedule={"timesteps": timesteps, "sigmas": sigmas},
                             output_type=output_type, progress=progress, masked_image_latents=masked_image_latents,
                             ip_adapter_masks=ip_adapter_masks)


class StableDiffusionXLImg2ImgPipeline(StableDiffusionXLPipeline):
    """SDXL image-to-image and the refiner (diffusers' ``StableDiffusionXLImg2ImgPipeline``): ``image`` is
    required; ``requires_aesthetics_score`` (``model_index.json``; true for the refiner) conditions on
    ``aesthetic_score`` / ``negative_aesthetic_score`` instead of the target size."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionXLImg2ImgPipeline"
    OPTIONS: ClassVar = {"requires_aesthetics_score": False, "force_zeros_for_empty_prompt": True}
    IMAGE_TO_IMAGE_IDS: ClassVar[bool] = True
    REQUIRED_INPUTS: ClassVar = ("image",)


class StableDiffusionXLInpaintPipeline(StableDiffusionXLPipeline):
    """SDXL inpainting (diffusers' ``StableDiffusionXLInpaintPipeline``): ``image`` and ``mask_image`` (white =
    repaint), with a 9-channel inpainting UNet or an ordinary one; ``strength`` defaults to 0.9999."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionXLInpaintPipeline"
    OPTIONS: ClassVar = {"requires_aesthetics_score": False, "force_zeros_for_empty_prompt": True}
    IMAGE_TO_IMAGE_IDS: ClassVar[bool] = True
    DEFAULT_GUIDANCE: ClassVar[float] = 7.5
    REQUIRED_INPUTS: ClassVar = ("image", "mask_image")
