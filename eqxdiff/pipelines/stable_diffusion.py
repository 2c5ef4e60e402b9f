"""Stable Diffusion 1.x/2.x text-to-image and image-to-image.

The steps are plain functions a notebook can call (``encode_prompt``, ``prepare_latents``,
``encode_image_latents``, ``denoise``, ``decode_latents``); :class:`StableDiffusionPipeline` strings them
together behind diffusers' argument names. The whole denoising loop is one jitted ``lax.fori_loop``.
"""

import dataclasses
import time
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ..nn import with_attention_implementation
from ._images import to_model_range, to_uint8
from ._progress import progress_bar, tick


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


def rescale_noise_cfg(noise_cfg, noise_text, guidance_rescale: float):
    """Rescale guided noise toward the text-conditioned noise's std (Lin et al. 2023, sec. 3.4)."""
    axes = tuple(range(1, noise_cfg.ndim))
    std_text = jnp.std(noise_text, axis=axes, keepdims=True, ddof=1)
    std_cfg = jnp.std(noise_cfg, axis=axes, keepdims=True, ddof=1)
    rescaled = noise_cfg * (std_text / std_cfg)
    return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg


@dataclasses.dataclass(frozen=True)
class Guidance:
    """Classifier-free guidance settings (static: they decide the traced graph)."""

    scale: float = 7.5
    rescale: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.scale > 1.0


@eqx.filter_jit
def denoise(unet, scheduler, state, latents: Float[Array, "batch height width channels"],
            embeds: Float[Array, "embed_batch seq embed"], key: PRNGKeyArray, *, guidance: Guidance,
            unet_kwargs: dict | None = None, progress: bool = False):
    """Run the scheduler's remaining steps from ``state``: the whole loop is one ``lax.fori_loop``.

    With guidance, ``embeds`` is ``[negative; positive]`` (twice the latents' batch) and the UNet runs once
    per step on both halves, as diffusers does.
    """
    unet_kwargs = unet_kwargs or {}

    def body(_, carry):
        x, st, k = carry
        t = scheduler.current_timestep(st)
        model_in = scheduler.scale_model_input(st, x)
        if guidance.enabled:
            model_in = jnp.concatenate([model_in, model_in])
        noise = unet(model_in, jnp.broadcast_to(t, (model_in.shape[0],)), embeds, **unet_kwargs)
        if guidance.enabled:
            uncond, text = jnp.split(noise, 2)
            noise = uncond + guidance.scale * (text - uncond)
            if guidance.rescale > 0:
                noise = rescale_noise_cfg(noise, text, guidance.rescale)
        k, sub = jax.random.split(k)
        x, st = scheduler.step(st, noise.astype(x.dtype), x, key=sub)
        if progress:
            jax.debug.callback(tick, st.step_index)
        return x, st, k

    steps = scheduler.remaining_steps(state)
    latents, state, _ = jax.lax.fori_loop(0, steps, body, (latents, state, key))
    return latents


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


class StableDiffusionPipeline:
    """Text-to-image and image-to-image with a CLIP text encoder, a UNet, a VAE and a scheduler.

    Call it with diffusers' argument names; it returns uint8 images ``[n, height, width, 3]``.
    """

    def __init__(self, *, tokenizer, text_encoder, unet, vae, scheduler, attention: str | None = None,
                 activations_dtype=jnp.float32, mesh=None, rules=None, offload_encoders: bool = False):
        """``mesh`` (an :func:`eqxdiff.parallel.make_mesh` mesh) runs every model on it: parameters placed by
        ``rules`` (default :data:`eqxdiff.parallel.DEFAULT_RULES`), activations constrained at block boundaries,
        the batch split over data+fsdp. ``offload_encoders`` keeps the text encoder's weights in host memory
        and puts them on the devices only while prompts are encoded, so they are gone before the loop."""
        self.activations_dtype = jnp.dtype(activations_dtype)
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.unet = with_attention_implementation(unet, attention) if attention else unet
        self.vae = with_attention_implementation(vae, attention) if attention else vae
        self.scheduler = scheduler
        self.timings: dict[str, float] = {}
        self.mesh, self.rules, self.offload_encoders = mesh, rules, offload_encoders
        if mesh is not None:
            from ..parallel import DEFAULT_RULES, Plan, shard_params, with_plan

            self.rules = rules = rules or DEFAULT_RULES
            plan = Plan(mesh, rules)
            for name in ("text_encoder", "unet", "vae"):
                model = getattr(self, name)
                if not (offload_encoders and name == "text_encoder"):
                    model = shard_params(model, mesh, rules)
                # Every model runs on the plan: batch over data+fsdp, the VAE's images with whole rows (its
                # attention's tokens over "context"). Row-split convolutions are left out by DEFAULT_RULES for an
                # XLA bug in their gradients (see there), which inference would not meet anyway.
                setattr(self, name, with_plan(model, plan))
        if offload_encoders:
            self.text_encoder = jax.device_get(self.text_encoder)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def with_scheduler(self, name: str) -> "StableDiffusionPipeline":
        """The same pipeline with another scheduler (``"euler"``, ``"dpm++2m_karras"`` ...), keeping the
        checkpoint's betas and prediction type."""
        from ..schedulers import scheduler_from_config

        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.scheduler = scheduler_from_config(self.scheduler.config.to_dict(), name=name)
        new.timings = {}
        return new

    def _check_size(self, height, width):
        f = self.vae_scale_factor
        for name, v in (("height", height), ("width", width)):
            if v % f:
                raise ValueError(f"{name}={v} must be a multiple of {f} (the VAE downsamples by {f}); "
                                 f"try {name}={max(f, v // f * f)}")

    def embed(self, prompts: Sequence[str], negative: Sequence[str], *, guidance: Guidance,
              clip_skip: int | None = None):
        ids = tokenize(self.tokenizer, list(negative) + list(prompts) if guidance.enabled else prompts)
        encoder = self.text_encoder
        if self.offload_encoders:  # host -> devices for this call only; released when `encoder` goes
            from ..parallel import shard_params

            encoder = (jax.tree.map(jnp.asarray, encoder) if self.mesh is None
                       else shard_params(encoder, self.mesh, self.rules))
        return encode_prompt(encoder, self._shard(jnp.asarray(ids)), clip_skip=clip_skip)

    def _shard(self, x):
        if self.mesh is None:
            return x
        from ..parallel import shard_batch

        return shard_batch(x, self.mesh, self.rules)

    def __call__(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] | None = None, *,
                 num_inference_steps: int = 50, guidance_scale: float = 7.5, guidance_rescale: float = 0.0,
                 height: int | None = None, width: int | None = None, num_images_per_prompt: int = 1,
                 latents=None, image=None, strength: float = 0.8, seed: int | None = None,
                 key: PRNGKeyArray | None = None, clip_skip: int | None = None,
                 progress: bool = True) -> np.ndarray:
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if negative_prompt is None:
            negative = [""] * len(prompts)
        else:
            negative = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
        if len(negative) != len(prompts):
            raise ValueError(f"negative_prompt has {len(negative)} entries but prompt has {len(prompts)}")
        if num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
        if key is None:
            key = jax.random.key(0 if seed is None else seed)
        f = self.vae_scale_factor
        n = len(prompts) * num_images_per_prompt
        guidance = Guidance(float(guidance_scale), float(guidance_rescale))

        t0 = time.perf_counter()
        embeds = self.embed(prompts, negative, guidance=guidance, clip_skip=clip_skip)
        embeds = jnp.repeat(embeds, num_images_per_prompt, axis=0).astype(self.activations_dtype)
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
                raise ValueError(f"got {pixels.shape[0]} images for {n} outputs; pass one image or one per output")
            pixels = jnp.broadcast_to(pixels, (n, *pixels.shape[1:]))
            self._check_size(pixels.shape[1], pixels.shape[2])
            if not 0.0 < strength <= 1.0:
                raise ValueError(f"strength must be in (0, 1], got {strength}")
            shape = (n, pixels.shape[1] // f, pixels.shape[2] // f, self.unet.config.in_channels)
            state = self.scheduler.init(num_inference_steps, sample_shape=shape, strength=strength)
            posterior_noise = jax.random.normal(posterior_key, shape)
            clean = encode_image_latents(self.vae, pixels, posterior_noise)
            noise = jax.random.normal(noise_key, shape) if latents is None else self._given_latents(latents, shape)
            x = self.scheduler.add_noise_at_step(state, clean, noise)
        x = jax.block_until_ready(x.astype(self.activations_dtype))
        self.timings["encode"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        steps = int(self.scheduler.remaining_steps(state))
        with progress_bar(steps, "denoising", enabled=progress):
            x, embeds = self._shard(x), self._shard(embeds)
            x = jax.block_until_ready(denoise(self.unet, self.scheduler, state, x, embeds, loop_key,
                                              guidance=guidance, progress=progress))
        self.timings["denoise"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        decoded = decode_latents(self.vae, x)
        if self.mesh is not None and not decoded.is_fully_addressable:  # multi-host: every host gets every image
            from jax.experimental import multihost_utils

            decoded = multihost_utils.process_allgather(decoded, tiled=True)
        images = to_uint8(decoded)
        self.timings["decode"] = time.perf_counter() - t0
        return images

    @staticmethod
    def _given_latents(latents, shape):
        arr = jnp.asarray(latents, dtype=jnp.float32)
        if arr.shape != shape:
            raise ValueError(f"latents must have shape {shape} = [n, height/8, width/8, channels] (channels-last), "
                             f"got {arr.shape}")
        return arr
