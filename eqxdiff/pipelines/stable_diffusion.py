"""Stable Diffusion 1.x/2.x text-to-image and image-to-image.

The steps are plain functions a notebook can call (``encode_prompt``, ``prepare_latents``,
``encode_image_latents``, ``denoise``, ``decode_latents``); :class:`StableDiffusionPipeline` strings them
together behind diffusers' argument names on the shared pipeline base. The whole denoising loop is one jitted
``lax.fori_loop`` (:func:`eqxdiff.pipelines.denoise_loop`).
"""

from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ._base import Component, DiffusionPipeline
from ._denoise import Denoiser, Guidance, denoise_loop, rescale_noise_cfg
from ._images import to_model_range, to_uint8
from ._progress import progress_bar

__all__ = ["StableDiffusionPipeline", "UNetDenoiser", "Guidance", "decode_latents", "denoise",
           "encode_image_latents", "encode_prompt", "prepare_latents", "rescale_noise_cfg", "to_model_range",
           "to_uint8", "tokenize"]


def tokenize(tokenizer, prompts: Sequence[str]) -> np.ndarray:
    """Token ids ``[n, model_max_length]``, padded and truncated as diffusers' pipelines do."""
    ids = tokenizer(list(prompts), padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="np").input_ids
    return np.asarray(ids, dtype=np.int32)


@eqx.filter_jit
@typechecked
def encode_prompt(text_encoder, input_ids: Int[Array, "batch seq"], *,
                  clip_skip: int | None = None) -> Float[Array, "batch seq embed"]:
    """Text embeddings for the UNet: the last hidden state, or with ``clip_skip`` the hidden state that
    many layers from the end passed through the final layer norm (diffusers' convention)."""
    if clip_skip is None:
        return text_encoder(input_ids).last_hidden_state
    out = text_encoder(input_ids, output_hidden_states=True)
    return text_encoder.text_model.final_layer_norm(out.hidden_states[-(clip_skip + 1)])


class UNetDenoiser(Denoiser):
    """A ``UNet2DConditionModel`` in the loop: ``cond`` holds ``encoder_hidden_states`` and any other keyword
    arrays the UNet takes (SDXL's ``text_embeds`` / ``time_ids``, ControlNet residuals)."""

    unet: Any

    def __call__(self, x, t, cond, *, step):
        extra = {k: v for k, v in cond.items() if k != "encoder_hidden_states"}
        return self.unet(x, jnp.broadcast_to(t, (x.shape[0],)), cond["encoder_hidden_states"], **extra)


def denoise(unet, scheduler, state, latents: Float[Array, "batch height width channels"],
            embeds: Float[Array, "embed_batch seq embed"], key: PRNGKeyArray, *, guidance: Guidance,
            unet_kwargs: dict | None = None, progress: bool = False):
    """Run the scheduler's remaining steps from ``state`` with ``unet`` (one ``lax.fori_loop``).

    With guidance, ``embeds`` is ``[negative; positive]`` (twice the latents' batch) and the UNet runs once
    per step on both halves, as diffusers does.
    """
    cond = {"encoder_hidden_states": embeds, **(unet_kwargs or {})}
    return denoise_loop(UNetDenoiser(unet), scheduler, state, latents, cond, key, guidance=guidance,
                        progress=progress)


def prepare_latents(key: PRNGKeyArray, shape: tuple[int, ...], scheduler, state, dtype=jnp.float32):
    """Initial noise ``[n, h/8, w/8, c]`` scaled by the scheduler's ``init_noise_sigma``."""
    return (jax.random.normal(key, shape, dtype) * scheduler.init_noise_sigma(state)).astype(dtype)


@eqx.filter_jit
def encode_image_latents(vae, image: Float[Array, "batch height width 3"],
                         posterior_noise: Float[Array, "batch h w latent"]):
    """VAE latents of ``[-1, 1]`` images, sampled with the given standard-normal noise, then scaled."""
    dist = vae.encode(image)
    return vae.scale_latents(dist.mean + dist.std * posterior_noise)


@eqx.filter_jit
def decode_latents(vae, latents: Float[Array, "batch h w latent"]) -> Float[Array, "batch height width 3"]:
    """Scaled latents back to ``[-1, 1]`` images."""
    return vae.decode(vae.unscale_latents(latents).astype(jnp.float32))


def _as_list(value, n: int, name: str) -> list:
    values = [value] * n if isinstance(value, str) else list(value)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries but prompt has {n}")
    return values


class StableDiffusionPipeline(DiffusionPipeline):
    """Text-to-image and image-to-image with a CLIP text encoder, a UNet, a VAE and a scheduler.

    Call it with diffusers' argument names; it returns uint8 images ``[n, height, width, 3]``. See
    :class:`~eqxdiff.pipelines.DiffusionPipeline` for ``attention``, ``activations_dtype``, ``mesh``, ``rules``
    and ``offload_encoders``.
    """

    CLASS_NAME: ClassVar[str] = "StableDiffusionPipeline"
    COMPONENTS: ClassVar[tuple[Component, ...]] = (
        Component("tokenizer", "transformers", "tokenizer"),
        Component("text_encoder", "transformers", encoder=True),
        Component("unet", "diffusers"),
        Component("vae", "diffusers", scan=False),
        Component("scheduler", "diffusers", "scheduler"),
    )
    INDEX_EXTRAS: ClassVar = {"feature_extractor": [None, None], "safety_checker": [None, None],
                              "requires_safety_checker": False, "image_encoder": [None, None]}

    def __init__(self, *, tokenizer, text_encoder, unet, vae, scheduler, attention: str | None = None,
                 activations_dtype=jnp.float32, mesh=None, rules=None, offload_encoders: bool = False):
        super().__init__(tokenizer=tokenizer, text_encoder=text_encoder, unet=unet, vae=vae, scheduler=scheduler,
                         attention=attention, activations_dtype=activations_dtype, mesh=mesh, rules=rules,
                         offload_encoders=offload_encoders)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def _check_size(self, height, width):
        f = self.vae_scale_factor
        for name, v in (("height", height), ("width", width)):
            if v % f:
                raise ValueError(f"{name}={v} must be a multiple of {f} (the VAE downsamples by {f}); "
                                 f"try {name}={max(f, v // f * f)}")

    def embed(self, prompts: Sequence[str], negative: Sequence[str], *, guidance: Guidance,
              clip_skip: int | None = None):
        """Text embeddings ``[negative; positive]`` with guidance, else ``positive``."""
        ids = tokenize(self.tokenizer, list(negative) + list(prompts) if guidance.enabled else prompts)
        return encode_prompt(self.encoder("text_encoder"), self.shard(jnp.asarray(ids)), clip_skip=clip_skip)

    def _embeddings(self, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, guidance, clip_skip):
        """``[negative; positive]`` (with guidance) or positive embeddings from prompts or given embeddings."""
        if prompt_embeds is None:
            if prompt is None:
                raise ValueError("pass prompt or prompt_embeds")
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            negative = [""] * len(prompts) if negative_prompt is None else _as_list(negative_prompt, len(prompts),
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
                negative = [""] * n if negative_prompt is None else _as_list(negative_prompt, n, "negative_prompt")
                return jnp.concatenate([self.embed(negative, [], guidance=Guidance(1.0), clip_skip=clip_skip),
                                        positive])
        if not guidance.enabled:
            return positive
        negative_embeds = jnp.asarray(negative_prompt_embeds, jnp.float32)
        if negative_embeds.shape != positive.shape:
            raise ValueError(f"negative_prompt_embeds {negative_embeds.shape} must have prompt_embeds' shape "
                             f"{positive.shape}")
        return jnp.concatenate([negative_embeds, positive])

    def __call__(self, prompt: str | Sequence[str] | None = None, negative_prompt: str | Sequence[str] | None = None,
                 *, num_inference_steps: int = 50, guidance_scale: float = 7.5, guidance_rescale: float = 0.0,
                 height: int | None = None, width: int | None = None, num_images_per_prompt: int = 1,
                 latents=None, image=None, strength: float = 0.8, seed: int | None = None,
                 key: PRNGKeyArray | None = None, clip_skip: int | None = None, prompt_embeds=None,
                 negative_prompt_embeds=None, progress: bool = True) -> np.ndarray:
        """Images for ``prompt`` (or ``prompt_embeds`` ``[n, seq, embed]``, with optional
        ``negative_prompt_embeds``). ``latents``: the initial noise ``[n, height/8, width/8, channels]``
        (channels-last), before the scheduler's ``init_noise_sigma``. ``image`` + ``strength``: image-to-image."""
        if num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
        if key is None:
            key = jax.random.key(0 if seed is None else seed)
        f = self.vae_scale_factor
        guidance = Guidance(float(guidance_scale), float(guidance_rescale))

        with self.timed("encode"):
            embeds = self._embeddings(prompt, negative_prompt, prompt_embeds, negative_prompt_embeds, guidance,
                                      clip_skip)
            embeds = jnp.repeat(embeds, num_images_per_prompt, axis=0).astype(self.activations_dtype)
            n = embeds.shape[0] // (2 if guidance.enabled else 1)
            noise_key, posterior_key, loop_key = jax.random.split(key, 3)
            if image is None:
                height = height or self.unet.config.sample_size * f
                width = width or self.unet.config.sample_size * f
                self._check_size(height, width)
                shape = (n, height // f, width // f, self.unet.config.in_channels)
                state = self.scheduler.init(num_inference_steps, sample_shape=shape)
                if latents is None:
                    x = prepare_latents(noise_key, shape, self.scheduler, state)
                else:
                    x = self._given_latents(latents, shape) * self.scheduler.init_noise_sigma(state)
            else:
                pixels = to_model_range(image)
                if pixels.shape[0] not in (1, n):
                    raise ValueError(f"got {pixels.shape[0]} images for {n} outputs; pass one image or one per "
                                     "output")
                pixels = jnp.broadcast_to(pixels, (n, *pixels.shape[1:]))
                self._check_size(pixels.shape[1], pixels.shape[2])
                if not 0.0 < strength <= 1.0:
                    raise ValueError(f"strength must be in (0, 1], got {strength}")
                shape = (n, pixels.shape[1] // f, pixels.shape[2] // f, self.unet.config.in_channels)
                state = self.scheduler.init(num_inference_steps, sample_shape=shape, strength=strength)
                posterior_noise = jax.random.normal(posterior_key, shape)
                clean = encode_image_latents(self.vae, pixels, posterior_noise)
                noise = jax.random.normal(noise_key, shape) if latents is None else self._given_latents(latents,
                                                                                                         shape)
                x = self.scheduler.add_noise_at_step(state, clean, noise)
            x = jax.block_until_ready(x.astype(self.activations_dtype))

        with self.timed("denoise"):
            steps = int(self.scheduler.remaining_steps(state))
            with progress_bar(steps, "denoising", enabled=progress):
                x, embeds = self.shard(x), self.shard(embeds)
                x = jax.block_until_ready(denoise(self.unet, self.scheduler, state, x, embeds, loop_key,
                                                  guidance=guidance, progress=progress))
        with self.timed("decode"):
            images = to_uint8(self.gather(decode_latents(self.vae, x)))
        return images

    @staticmethod
    def _given_latents(latents, shape):
        arr = jnp.asarray(latents, dtype=jnp.float32)
        if arr.shape != shape:
            raise ValueError(f"latents must have shape {shape} = [n, height/8, width/8, channels] (channels-last), "
                             f"got {arr.shape}")
        return arr
