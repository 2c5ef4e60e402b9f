"""Stable Diffusion 1.x/2.x: text-to-image, image-to-image and inpainting.

The steps are plain functions a notebook can call (``encode_prompt`` here; ``tokenize``, shared by every family's
prompts; ``prepare_latents``, ``encode_image_latents``, ``denoise``, ``decode_latents`` shared with SDXL);
:class:`StableDiffusionPipeline` strings them together behind diffusers' argument names on the shared UNet pipeline
base. The whole denoising loop is one jitted ``lax.fori_loop`` (:func:`eqxdiff.pipelines.denoise_loop`).
"""

from collections.abc import Sequence
from typing import ClassVar

import jax.numpy as jnp

from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ..core import program
from ._arguments import as_list, given_array, prompt_list, resolve_key
from ._call import checked_call
from ._components import Component
from ._denoise import Guidance, rescale_noise_cfg
from ._images import to_model_range, to_uint8
from ._latents import decode_latents, encode_image_latents
from ._mask_crop import mask_cropped
from ._text import tokenize, tokens
from ._unet import UNetDenoiser, UNetPipeline, denoise, prepare_latents

__all__ = ["Guidance", "StableDiffusionInpaintPipeline", "StableDiffusionPipeline", "UNetDenoiser", "decode_latents",
           "denoise", "encode_image_latents", "encode_prompt", "prepare_latents", "rescale_noise_cfg",
           "to_model_range", "to_uint8", "tokenize"]


@program
@typechecked
def encode_prompt(text_encoder, input_ids: Int[Array, "batch seq"], *, clip_skip: int | None = None,
                  unskipped: int = 0, attention_mask: Int[Array, "batch seq"] | None = None
                  ) -> Float[Array, "batch seq embed"]:
    """Text embeddings for the UNet: the last hidden state, or with ``clip_skip`` the hidden state that
    many layers from the end passed through the final layer norm (diffusers' convention). The first ``unskipped``
    rows (the negative prompts of a guided batch) take the last hidden state whatever ``clip_skip``: diffusers'
    ``encode_prompt`` applies ``clip_skip`` to the prompts only. ``attention_mask``: the tokenizer's, for a text
    encoder whose config says ``use_attention_mask`` (diffusers passes it then, and none otherwise)."""
    if clip_skip is None:
        return text_encoder(input_ids, attention_mask=attention_mask).last_hidden_state
    out = text_encoder(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    skipped = text_encoder.text_model.final_layer_norm(out.hidden_states[-(clip_skip + 1)])
    if not unskipped:
        return skipped
    return jnp.concatenate([out.last_hidden_state[:unskipped], skipped[unskipped:]])


class StableDiffusionPipeline(UNetPipeline):
    """Text-to-image, image-to-image and inpainting with a CLIP text encoder, a UNet, a VAE and a scheduler.

    Call it with diffusers' argument names; it returns uint8 images ``[n, height, width, 3]`` (``"np"``
    floats, ``"pil"`` images, or the final latents with ``output_type="latent"``). See
    :class:`~eqxdiff.pipelines.DiffusionPipeline` for ``attention``,
    ``activations_dtype``, ``mesh``, ``rules`` and ``offload_encoders``.
    """

    CLASS_NAME: ClassVar[str] = "StableDiffusionPipeline"
    LATENT_NORM: ClassVar[str] = "scale"  # diffusers' SD pipelines read scaling_factor only
    LORA_FORMAT: ClassVar[str] = "eqxdiff.pipelines._lora_unet:SD"
    LORA_SCALE_ARGUMENT: ClassVar[str | None] = "cross_attention_kwargs"  # {"scale": s} (diffusers)
    # diffusers' SD pipelines' constructors rewrite an outdated scheduler config (a deprecation warning there)
    SCHEDULER_FIXES: ClassVar = {"steps_offset": 1, "clip_sample": False}
    COMPONENTS: ClassVar[tuple[Component, ...]] = (
        Component("tokenizer", "transformers", "tokenizer"),
        Component("text_encoder", "transformers", classes=("CLIPTextModel",), encoder=True),
        Component("unet", "diffusers", classes=("UNet2DConditionModel",)),
        Component("vae", "diffusers", classes=("AutoencoderKL",), scan=False),
        Component("scheduler", "diffusers", "scheduler"),
    )
    INDEX_EXTRAS: ClassVar = {"feature_extractor": [None, None], "safety_checker": [None, None],
                              "requires_safety_checker": False, "image_encoder": [None, None]}

    def embed(self, prompts: Sequence[str], negative: Sequence[str], *, guidance: Guidance,
              clip_skip: int | None = None):
        """Text embeddings ``[negative; positive]`` with guidance, else ``positive``; ``clip_skip`` for the
        positive prompts only, as diffusers' (its negative prompts take the last hidden state)."""
        config = self.text_encoder.config
        texts = list(negative) + list(prompts) if guidance.enabled else prompts
        ids = tokens(self.tokenizer, self.maybe_convert_prompt(texts, self.tokenizer),
                     vocab_size=config.vocab_size)
        mask = self.shard(jnp.asarray(ids.mask)) if config.use_attention_mask else None
        return encode_prompt(self.encoder("text_encoder"), self.shard(jnp.asarray(ids.ids)), clip_skip=clip_skip,
                             unskipped=len(negative) if guidance.enabled else 0, attention_mask=mask)

    def _embeddings(self, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, guidance, clip_skip):
        """``[negative; positive]`` (with guidance) or positive embeddings from prompts or given embeddings."""
        if prompt_embeds is None:
            if prompt is None:
                raise ValueError("pass prompt or prompt_embeds")
            prompts = prompt_list(prompt)
            negative = [""] * len(prompts) if negative_prompt is None else as_list(negative_prompt, len(prompts),
                                                                                   "negative_prompt")
            if negative_prompt_embeds is None:
                return self.embed(prompts, negative, guidance=guidance, clip_skip=clip_skip)
            positive = self.embed(prompts, [], guidance=Guidance(1.0), clip_skip=clip_skip)
        else:
            if prompt is not None:
                raise ValueError("pass prompt or prompt_embeds, not both")
            positive = jnp.asarray(prompt_embeds, jnp.float32)
            if positive.ndim != 3:
                raise ValueError(f"prompt_embeds must be [n, seq, embed], got shape {positive.shape}")
            if not guidance.enabled:
                return positive
            if negative_prompt_embeds is None:
                n = positive.shape[0]
                negative = [""] * n if negative_prompt is None else as_list(negative_prompt, n, "negative_prompt")
                return jnp.concatenate([self.embed(negative, [], guidance=Guidance(1.0)), positive])
        if not guidance.enabled:
            return positive
        negative_embeds = given_array(negative_prompt_embeds, positive.shape, "negative_prompt_embeds",
                                      "prompt_embeds' shape [n, seq, embed]")
        return jnp.concatenate([negative_embeds, positive])

    @checked_call
    @mask_cropped
    def __call__(self, prompt: str | Sequence[str] | None = None, negative_prompt: str | Sequence[str] | None = None,
                 *, num_inference_steps: int = 50, guidance_scale: float = 7.5, guidance_rescale: float = 0.0,
                 height: int | None = None, width: int | None = None, num_images_per_prompt: int = 1,
                 latents=None, image=None, mask_image=None, strength: float | None = None, eta: float = 0.0,
                 timesteps: Sequence[int] | None = None, sigmas: Sequence[float] | None = None,
                 seed: int | None = None, key: PRNGKeyArray | None = None, clip_skip: int | None = None,
                 prompt_embeds=None, negative_prompt_embeds=None, masked_image_latents=None,
                 padding_mask_crop: int | None = None, ip_adapter_image=None, ip_adapter_image_embeds=None,
                 ip_adapter_masks=None, output_type: str = "uint8", progress: bool = True):
        """Images for ``prompt`` (or ``prompt_embeds`` ``[n, seq, embed]``, with optional
        ``negative_prompt_embeds``): uint8 ``[n, height, width, 3]``, or the final latents channels-last with
        ``output_type="latent"``. See :meth:`~eqxdiff.pipelines._unet.UNetPipeline.generate`.

        Args:
            latents: The initial noise ``[n, height/8, width/8, channels]``, channels-last (an array), before the
                scheduler's ``init_noise_sigma``.
            image: Image-to-image or inpainting input: uint8 ``[n, H, W, 3]``, PIL, or floats in [0, 1].
            mask_image: Inpainting mask (white = repaint), the image's size; works with inpainting (9-channel) and
                ordinary UNets.
            strength: How much of the schedule an image-to-image / inpainting run takes (default 0.8 / 1.0).
            eta: Noise of the DDIM / TCD steps.
            guidance_rescale: Rescales the guided prediction, with ``image=`` too. diffusers' SD image-to-image and
                inpainting pipelines take no ``guidance_rescale``: their ``**kwargs`` swallow it and they run
                without it, so match them there with ``guidance_rescale=0``.
            timesteps: A custom descending timestep schedule (replaces ``num_inference_steps``).
            sigmas: A custom noise-level schedule (replaces ``num_inference_steps``).
            masked_image_latents: An inpainting UNet's masked-image latents ``[1 or n, h, w, c]`` (channels-last,
                scaled as latents), used instead of encoding the masked image.
            ip_adapter_image: The image prompt of the loaded IP-Adapter(s): one entry per adapter, each an image (PIL
                or uint8 ``[h, w, 3]``) or a list of images read together (``[[a, b]]``: two on one adapter;
                :meth:`~eqxdiff.pipelines._ip_adapter.IPAdapterMixin.load_ip_adapter`).
            ip_adapter_image_embeds: Their CLIP image embeddings instead, one array per adapter ``[2 (negative;
                positive) with guidance, else 1, images, embed]`` (diffusers' ``prepare_ip_adapter_image_embeds``).
            ip_adapter_masks: Where each adapter's images act: one entry per adapter, ``None`` or ``[1, images,
                height, width]`` (diffusers' ``IPAdapterMaskProcessor().preprocess`` output reshaped, or
                :func:`~eqxdiff.pipelines.prepare_ip_adapter_masks`); diffusers' ``cross_attention_kwargs={
                "ip_adapter_masks": ...}`` is taken too (:mod:`~eqxdiff.pipelines._ip_adapter_masks`).
            padding_mask_crop: Inpaint only the box around the mask, padded by this many pixels, at the output size,
                pasted back into the picture (PIL ``image`` and ``mask_image``; :mod:`~eqxdiff.pipelines._mask_crop`).
            output_type: ``"uint8"`` images, ``"np"`` (float32 in [0, 1]), ``"pil"`` (a list of PIL
                images) or ``"latent"`` (channels-last latents).
        """
        self.check_inputs(image=image, mask_image=mask_image)
        key = resolve_key(seed, key)
        guidance = self.guidance(guidance_scale, guidance_rescale)
        with self.timed("encode"):
            embeds = self._embeddings(prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, guidance,
                                      clip_skip)
            embeds = jnp.repeat(embeds, num_images_per_prompt, axis=0)
            embeds, pipe = self.with_ip_adapter_tokens(embeds, ip_adapter_image, ip_adapter_image_embeds,
                                                       guidance.enabled, num_images_per_prompt=num_images_per_prompt)
        n, source, height, width, strength = self.image_inputs(embeds, guidance, image, mask_image, height, width,
                                                             strength)
        return pipe.generate({"encoder_hidden_states": embeds}, guidance=guidance, guidance_scale=guidance_scale,
                             batch=n, height=height, width=width, num_inference_steps=num_inference_steps, key=key,
                             latents=latents, image=source, mask_image=mask_image, strength=strength, eta=eta,
                             schedule={"timesteps": timesteps, "sigmas": sigmas}, output_type=output_type,
                             progress=progress, masked_image_latents=masked_image_latents,
                             ip_adapter_masks=ip_adapter_masks)


class StableDiffusionInpaintPipeline(StableDiffusionPipeline):
    """Stable Diffusion inpainting (diffusers' ``StableDiffusionInpaintPipeline`` folders, 9-channel UNets):
    :class:`StableDiffusionPipeline`, with ``image`` and ``mask_image`` required."""

    CLASS_NAME: ClassVar[str] = "StableDiffusionInpaintPipeline"
    REQUIRED_INPUTS: ClassVar = ("image", "mask_image")
    SCHEDULER_FIXES: ClassVar = {"steps_offset": 1, "skip_prk_steps": True}  # diffusers' (its clip_sample stays)
