"""LTX-Video text-to-video (diffusers' ``LTXPipeline`` folders: ``Lightricks/LTX-Video`` 0.9.0 / 0.9.1,
``Lightricks/LTX-Video-0.9.5``, the 0.9.7 / 0.9.8 2B and 13B dev and distilled folders) and what the family's other
pipelines build on: image-to-video (:mod:`eqxdiff.pipelines.ltx_i2v`), conditions at frame indices
(:mod:`eqxdiff.pipelines.ltx_condition`) and the latent upsampler (:mod:`eqxdiff.pipelines.ltx_upsample`).

>>> pipe = eqxdiff.load_pipeline("Lightricks/LTX-Video-0.9.5", dtype="bfloat16")
>>> video = pipe("a cat surfing a wave", height=512, width=768, num_frames=121, decode_timestep=0.05)

**Prompts.** T5 v1.1-XXL reads the prompt (``max_sequence_length`` 128 tokens, padded) **without** an attention mask,
as diffusers does (its condition pipeline encodes with the mask: so does eqxdiff's); the mask is the transformer's
cross-attention mask. ``prompt_embeds`` (``[n, seq, 4096]``) need their ``prompt_attention_mask`` (``[n, seq]``,
1 = token), ``negative_prompt_embeds`` theirs. The negative prompt is encoded at ``max_sequence_length`` as diffusers
encodes it, beside ``prompt_embeds`` too; both halves need one length (refused otherwise, where diffusers fails to
concatenate them: pass ``max_sequence_length`` = their length). Classifier-free guidance runs when
``guidance_scale > 1`` (the negative prompt defaulting to ``""``), both halves in one batch, with ``guidance_rescale``.
Each video's cross-attention mask is its own prompt's. diffusers' LTX pipelines (text-to-video, image-to-video and
conditions) repeat the embeddings prompt by prompt (``p0, p0, p1, p1``) but tile the masks (``m0, m1, m0, m1``), so
with several prompts of different lengths and ``num_videos_per_prompt > 1`` a video reads its prompt through another
prompt's mask; eqxdiff does not copy that, and such calls differ from diffusers' (one prompt, or one video per prompt,
match).

**Schedule.** Flow-matching Euler over ``linspace(1, 1/N, N)`` sigmas, shifted by ``mu`` for the video's latent token
count where the scheduler shifts dynamically (0.9.0 / 0.9.1; 0.9.5+ shift statically); ``timesteps`` replaces them
with a custom schedule (the distilled models' recipes; diffusers' ``LTXPipeline`` refuses ``timesteps`` beside its
own sigmas, its ``LTXConditionPipeline`` takes them as here). The transformer positions its tokens by
``rope_interpolation_scale = (8 / frame_rate, 32, 32)``: ``frame_rate`` (default 25) conditions the model, and is the
saved video's rate unless ``eqxdiff-generate --fps`` says otherwise.

**Latents** are unpacked and channels-last, ``[n, T, h, w, C]`` with ``T = (num_frames - 1) / 8 + 1``,
``h, w = height / 32, width / 32`` (``C`` = 128): ``num_frames`` is ``8k + 1``, heights and widths multiples of 32,
each refused in one line otherwise. The transformer packs them into tokens itself: ``C`` is its ``in_channels`` over
the patch (``p * p * pt``). diffusers' LTX pipelines take ``in_channels`` itself as the latents' channels, so only
patch-1 transformers (every released checkpoint) run there; eqxdiff's run patched ones too.

**Decoding.** The latents are un-normalised by the VAE's statistics. A timestep-conditioned decoder (0.9.1+) decodes
at ``decode_timestep`` (default 0; the model cards use 0.03-0.05) after mixing fresh noise into the latents,
``(1 - s) z + s noise`` with ``s = decode_noise_scale`` (default ``decode_timestep``); both are one value, one per
prompt (repeated for its videos) or one per video. diffusers' LTX pipelines (text-to-video, image-to-video,
conditions) make one value per prompt, not per video: with ``num_videos_per_prompt > 1`` their timestep-conditioned
decode fails on a size mismatch unless given one value per video. That noise, and the noise 0.9.1's decoder injects,
are drawn from the call's key after the loop (:func:`decode_keys`), as diffusers draws them from its generator after
the loop. ``enable_vae_tiling()`` decodes in spatial tiles and windows of 16 frames every 8 (diffusers' framewise
decoding: two latent frames every one at the released VAEs' temporal factor of 8).
``decode_timestep`` and ``decode_noise_scale`` are traced values: changing them compiles nothing, as guidance and
the step count do not.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import nn
from .._typing import Array, Float, Int, PRNGKeyArray
from ..core import program
from ..models.ltx import LTXVideoTransformer3DModel, pack_latents, unpack_latents
from ..schedulers import to_device
from ._arguments import given_array, prompt_list, resolve_key
from ._call import checked_call
from ._checks import CallLimits, InputError, pixel_size
from ._components import Component
from ._denoise import Denoiser, Guidance, plan_schedule
from ._images import to_model_range
from ._latents import LatentPipeline, noise_draws
from ._text import prompt_pair, tokens

__all__ = ["DEFAULT_FRAME_RATE", "MAX_SEQUENCE_LENGTH", "LTXDenoiser", "LTXPipeline", "PromptEmbeds",
           "check_frame_rate", "coords_rope", "decode_keys", "decode_options", "decode_video", "grid_rope",
           "one_picture", "sampled_latents", "schedule_for", "shift_mu", "t5_embeddings"]

MAX_SEQUENCE_LENGTH = 128  # diffusers' LTXPipeline / LTXImageToVideoPipeline default prompt length
DEFAULT_SIZE = (512, 704)  # diffusers' default height, width
DEFAULT_FRAMES = 161
DEFAULT_FRAME_RATE = 25
LATENTS_LAYOUT = "[n, (num_frames - 1) / t + 1, height/f, width/f, C] (channels-last; t, f: the VAE's factors)"
_DECODE_DRAWS = 0x17D  # the call key's fold for the draws after the loop (decode noise, injected noise)


# -- prompts ------------------------------------------------------------------------------------------------------


@program
def t5_embeddings(text_encoder, input_ids: Int[Array, "batch seq"], mask: Int[Array, "batch seq"] | None = None):
    """T5's ``last_hidden_state``, without an attention mask (``None``: the padding is encoded too, as diffusers'
    ``LTXPipeline`` and ``LTXImageToVideoPipeline`` do) or with it (its ``LTXConditionPipeline``)."""
    return text_encoder(input_ids, attention_mask=mask).last_hidden_state


@dataclasses.dataclass(frozen=True)
class PromptEmbeds:
    """T5 embeddings ``[n, seq, caption]`` and their attention mask ``[n, seq]`` (1 = token, 0 = padding): the
    transformer's cross-attention mask."""

    embeds: Any
    mask: Any

    def repeat(self, k: int) -> "PromptEmbeds":
        """Each row ``k`` times in a row (``num_videos_per_prompt``)."""
        return PromptEmbeds(jnp.repeat(self.embeds, k, axis=0), jnp.repeat(self.mask, k, axis=0))

    def after(self, first: "PromptEmbeds") -> "PromptEmbeds":
        """``[first; self]`` along the batch: batched guidance's ``[negative; positive]``."""
        return PromptEmbeds(jnp.concatenate([first.embeds, self.embeds]), jnp.concatenate([first.mask, self.mask]))


# -- positions, decoding ------------------------------------------------------------------------------------------


@program
def grid_rope(transformer, grid: tuple[int, int, int], scale) -> nn.Rope:
    """The rotary tables ``[1, seq, inner]`` of a token ``grid`` at ``rope_interpolation_scale`` ``scale`` (a float32
    array ``[3]``: traced, so a new frame rate compiles nothing)."""
    return transformer.rotary_embedding(grid, (scale[0], scale[1], scale[2]))


@program
def coords_rope(transformer, video_coords) -> nn.Rope:
    """The rotary tables ``[b, seq, inner]`` of explicit ``video_coords [b, 3, seq]`` (the condition pipeline's)."""
    return transformer.rotary_embedding(video_coords=video_coords)


def decode_keys(key: PRNGKeyArray) -> tuple[PRNGKeyArray, PRNGKeyArray]:
    """``(noise_key, inject_key)``: what a call with ``key`` draws after its loop, the noise mixed into the latents of
    a timestep-conditioned decoder (``normal(noise_key, latents.shape)``) and the key of the noise its ResNet blocks
    inject (:meth:`~eqxdiff.models.ltx_vae.AutoencoderKLLTXVideo.decode`)."""
    noise_key, inject_key = jax.random.split(jax.random.fold_in(key, _DECODE_DRAWS))
    return noise_key, inject_key


@program
def decode_video(vae, latents, timestep, noise_scale, key, *, tiled: bool = False, frame_chunk: int | None = None,
                 dtype=jnp.float32):
    """Normalised latents ``[n, T, h, w, C]`` to ``[-1, 1]`` videos: un-normalised, mixed with fresh noise (``(1 - s)
    z + s noise``, ``s = noise_scale [n]``) in float32 and decoded in ``dtype`` (the pipeline's activations dtype, as
    diffusers decodes in the VAE's) at ``timestep [n]`` by a timestep-conditioned decoder (``timestep`` ``None``: a
    decoder without conditioning, no noise mixed). ``key``: :func:`decode_keys`' pair's source."""
    z = vae.unscale_latents(latents.astype(jnp.float32))
    noise_key, inject_key = decode_keys(key)
    if timestep is not None:
        s = noise_scale.astype(jnp.float32)[:, None, None, None, None]
        z = (1 - s) * z + s * jax.random.normal(noise_key, z.shape, jnp.float32)
    inject = inject_key if vae.config.injects_noise else None
    return vae.decode(z.astype(dtype), timestep, key=inject, tiled=tiled, frame_chunk=frame_chunk)


@program
def sampled_latents(vae, video: Float[Array, "b frames height width 3"], noise: Float[Array, "n t h w c"]
                    ) -> Float[Array, "n t h w c"]:
    """The normalised latents of ``video`` sampled from its posterior with the standard-normal ``noise`` (one draw
    per row): ``(mean + std * noise - latents_mean) / latents_std``, diffusers' ``retrieve_latents`` then
    ``_normalize_latents``. ``video``: one clip for every row, or ``b`` clips for ``n = b k`` rows (each clip's
    ``k`` rows in a row). Like diffusers' image-to-video, condition and upsample pipelines, this leaves out the
    VAE's ``scaling_factor`` (``_normalize_latents``' default 1.0), which the decode divides by (1.0 in every
    released LTX-Video VAE)."""
    posterior = vae.encode(video)
    mean, logvar = posterior.mean, posterior.logvar
    if video.shape[0] > 1:  # each clip's posterior for its rows
        mean, logvar = (jnp.repeat(a, noise.shape[0] // video.shape[0], axis=0) for a in (mean, logvar))
    z = mean + jnp.exp(0.5 * logvar) * noise
    return (z - vae.latents_mean.astype(z.dtype)) / vae.latents_std.astype(z.dtype)


def one_picture(image, name: str, size: tuple[int, int], *, prompts: int = 1) -> Array:
    """One picture (uint8 ``[H, W, 3]`` or ``[1, H, W, 3]``, PIL, floats in [0, 1]) as ``[1, H, W, 3]`` in [-1, 1],
    or one per prompt (``[prompts, H, W, 3]``, a list of PIL images), checked to be the video's ``size``."""
    pixels = to_model_range(image, name)
    if pixels.shape[0] not in (1, prompts):
        per = f" for {prompts} prompts; pass one picture (it conditions every video) or one per prompt" if prompts > 1 \
            else "; pass one picture (it conditions every video), or one per prompt with a list of prompts"
        raise InputError(f"{name} holds {pixels.shape[0]} images{per}")
    if tuple(pixels.shape[1:3]) != tuple(size):
        raise InputError(f"{name} has {pixel_size(*pixels.shape[1:3])} pixels but the video has {pixel_size(*size)}; "
                         "resize or crop it to the video's size (eqxdiff does not resize input images), or leave "
                         "height/width unset")
    return pixels


# -- the model in the loop ----------------------------------------------------------------------------------------


class LTXDenoiser(Denoiser):
    """The LTX-Video transformer in :func:`~eqxdiff.pipelines.denoise_loop` on latents ``[b, T, h, w, C]`` (float32;
    the model runs in ``dtype``). ``cond``: ``embeds`` / ``mask`` (T5's, ``[negative; positive]`` when guided),
    ``rope`` (:func:`grid_rope`); image-to-video adds ``token_mask`` (``[1, seq]``, 0 on the image's tokens: the
    model's per-token timestep is ``token_mask * t``), ``first_frame`` (the image's latents) and ``frame_mask`` (0 on
    the first latent frame, 1 after), which keep the first frame the image's after every step (diffusers steps only
    the frames after it)."""

    transformer: LTXVideoTransformer3DModel
    dtype: Any = eqx.field(static=True, default=jnp.float32)

    def __call__(self, x, t, cond, *, step):
        c = self.transformer.config
        grid = self.transformer.grid(*x.shape[1:4])
        tokens = pack_latents(x.astype(self.dtype), c.patch_size, c.patch_size_t)
        t = t.astype(jnp.float32)
        timestep = cond["token_mask"] * t if "token_mask" in cond else jnp.broadcast_to(t, (x.shape[0],))
        out = self.transformer.forward_tokens(tokens, cond["embeds"], timestep, cond["mask"], cond["rope"])
        return unpack_latents(out, grid, c.patch_size, c.patch_size_t)

    def after_step(self, x, t, cond, *, step, scheduler, state, last):
        if "first_frame" not in cond:
            return x
        return jnp.where(cond["frame_mask"] > 0, x, cond["first_frame"].astype(x.dtype))


# -- the pipeline -------------------------------------------------------------------------------------------------


class LTXPipeline(LatentPipeline):
    """LTX-Video text-to-video (diffusers' ``LTXPipeline``): uint8 frames ``[n, num_frames, height, width, 3]`` from
    prompts, with diffusers' argument names; see the module docstring, and
    :class:`~eqxdiff.pipelines.DiffusionPipeline` for ``attention``, ``activations_dtype``, ``mesh``, ``rules`` and
    ``offload_encoders``."""

    CLASS_NAME: ClassVar[str] = "LTXPipeline"
    COMPONENTS: ClassVar[tuple[Component, ...]] = (
        Component("tokenizer", "transformers", "tokenizer"),
        Component("text_encoder", "transformers", classes=("T5EncoderModel",), encoder=True),
        Component("vae", "diffusers", classes=("AutoencoderKLLTXVideo",), scan=False),
        Component("scheduler", "diffusers", "scheduler"),
        Component("transformer", "diffusers", classes=("LTXVideoTransformer3DModel",)),
    )
    INIT_IMAGE: ClassVar[str | None] = None  # text-to-video: no image argument
    T5_MASK: ClassVar[bool] = False  # whether T5 encodes the prompts with their attention mask
    FRAME_CHUNK_SAMPLE_FRAMES: ClassVar[int | None] = 16  # diffusers' LTX VAE decodes 16 frames every 8 (2 latent
    # frames every 1 at the released VAEs' temporal factor 8, 4 every 2 at a factor of 4)
    LORA_FORMAT: ClassVar[str | None] = "eqxdiff.pipelines._lora_ltx:LTX"
    LORA_SCALE_ARGUMENT: ClassVar[str | None] = "attention_kwargs"  # {"scale": s} (diffusers)

    # -- sizes and limits ----------------------------------------------------------------------------------------

    @property
    def default_fps(self) -> int:
        """The frame rate videos are saved at when the call gives none: diffusers' default ``frame_rate``."""
        return DEFAULT_FRAME_RATE

    @property
    def latent_channels(self) -> int:
        """Channels of the latents the scheduler steps (unpacked: the transformer's input features per patch)."""
        return self.transformer.config.latent_channels[0]

    LIMIT_COMPONENTS: ClassVar[tuple[str, ...]] = ("vae", "transformer")

    @classmethod
    def limits_from(cls, vae, transformer) -> CallLimits:
        patch, frames = (1, 1) if transformer is None else (transformer.patch_size, transformer.patch_size_t)
        return CallLimits.of_patches(vae, (patch, patch), native_size=DEFAULT_SIZE, frame_patch=frames)

    def check_call(self, arguments) -> None:
        """The schedule exists for the steps (or ``timesteps``) asked for (once loaded: ``eqxdiff-generate`` checks it
        before)."""
        if "frame_rate" in arguments:
            check_frame_rate(arguments["frame_rate"])
        steps, timesteps = arguments.get("num_inference_steps"), arguments.get("timesteps")
        if steps is not None or timesteps is not None:  # module functions: eqxdiff-generate's stand-in self
            schedule_for(self.scheduler, steps, (1, 1, 1, 1, 1), timesteps)

    # -- prompts -------------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt, *, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> PromptEmbeds:
        """T5 embeddings ``[n, max_sequence_length, 4096]`` of ``prompt`` (one string or several) and their attention
        mask, encoded without the mask (with it where :attr:`T5_MASK` says so), as diffusers' pipeline does."""
        for name in ("tokenizer", "text_encoder"):
            if getattr(self, name, None) is None:
                raise InputError(f"this pipeline has no {name}; pass prompt_embeds and prompt_attention_mask")
        ids = tokens(self.tokenizer, prompt_list(prompt), max_length=max_sequence_length,
                     vocab_size=self.text_encoder.config.vocab_size,
                     fix="Shorten the prompt or raise max_sequence_length")
        arrays = self.shard({"ids": jnp.asarray(ids.ids), "mask": jnp.asarray(ids.mask)})
        embeds = t5_embeddings(self.encoder("text_encoder"), arrays["ids"], arrays["mask"] if self.T5_MASK else None)
        return PromptEmbeds(embeds, arrays["mask"])

    def _given(self, embeds, mask, name: str) -> PromptEmbeds:
        dim = self.transformer.config.caption_channels
        embeds = jnp.asarray(embeds, jnp.float32)
        if embeds.ndim != 3 or embeds.shape[-1] != dim:
            raise InputError(f"{name} must be [n, seq, {dim}] (T5's width, the transformer's caption_channels), got "
                             f"shape {embeds.shape}")
        mask_name = name.replace("embeds", "attention_mask")
        if mask is None:
            raise InputError(f"{name} needs {mask_name} [n, seq] (1 for a prompt's tokens, 0 for padding: the "
                             "transformer's cross-attention mask); pass it too, as diffusers requires")
        mask = jnp.asarray(mask).astype(jnp.int32)
        if mask.shape != embeds.shape[:2]:
            raise InputError(f"{mask_name} must be [n, seq] = {embeds.shape[:2]} ({name}'s), got shape {mask.shape}")
        return PromptEmbeds(embeds, mask)

    def text_conditioning(self, prompt=None, negative_prompt=None, *, guided: bool, prompt_embeds=None,
                          prompt_attention_mask=None, negative_prompt_embeds=None,
                          negative_prompt_attention_mask=None, max_sequence_length: int = MAX_SEQUENCE_LENGTH
                          ) -> tuple[PromptEmbeds, PromptEmbeds | None]:
        """``(positive, negative)`` embeddings with their masks, the negative only when ``guided``
        (:func:`~eqxdiff.pipelines._text.prompt_pair`)."""
        masks = {"prompt_embeds": prompt_attention_mask, "negative_prompt_embeds": negative_prompt_attention_mask}
        return prompt_pair(lambda prompts, length: self.encode_prompt(prompts, max_sequence_length=length),
                           lambda embeds, name: self._given(embeds, masks[name], name), prompt=prompt,
                           negative_prompt=negative_prompt, prompt_embeds=prompt_embeds,
                           negative_prompt_embeds=negative_prompt_embeds, guided=guided,
                           max_sequence_length=max_sequence_length, shape=lambda e: e.embeds.shape)

    def prompts(self, num_videos_per_prompt: int, **text) -> tuple[PromptEmbeds, PromptEmbeds | None]:
        """:meth:`text_conditioning` with every row repeated for its videos, timed as ``encode``."""
        with self.timed("encode"):
            positive, negative = self.text_conditioning(**text)
            return positive.repeat(num_videos_per_prompt), None if negative is None else negative.repeat(
                num_videos_per_prompt)

    # -- schedule, positions, decoding ---------------------------------------------------------------------------

    def shift_mu(self, shape) -> float | None:
        """diffusers' ``mu`` for latents of ``shape`` (:func:`shift_mu`)."""
        return shift_mu(self.scheduler, shape)

    def schedule(self, num_inference_steps: int | None, shape, timesteps=None):
        """The scheduler's plan for latents of ``shape`` (:func:`schedule_for`)."""
        return schedule_for(self.scheduler, num_inference_steps, shape, timesteps)

    def rope_scale(self, frame_rate: float) -> Array:
        """``rope_interpolation_scale`` ``(vae_temporal / frame_rate, vae_spatial, vae_spatial)`` as a float32 array
        (diffusers' Python floats, rounded as its float32 positions round them)."""
        check_frame_rate(frame_rate)
        f = self.vae_scale_factor
        return to_device(np.asarray([self.vae_temporal_factor / frame_rate, f, f], np.float32))

    def decode(self, latents, *, timestep=None, noise_scale=None, key=None) -> Array:
        """The final latents as ``[-1, 1]`` videos (:func:`decode_video`) at the call's ``timestep`` and
        ``noise_scale`` (``[n]`` arrays; ``None`` for a decoder without timestep conditioning), drawing from ``key``
        (the call's: :func:`decode_keys`), with the pipeline's tiling settings."""
        if key is None:
            key = jax.random.key(0)
        return decode_video(self.vae, latents, timestep, noise_scale, key, tiled=self.vae_tiling,
                            frame_chunk=self.vae_frame_chunk, dtype=self.vae_dtype)

    def decode_options(self, decode_timestep, decode_noise_scale, videos: int, key) -> dict:
        """:meth:`decode`'s keywords for a call of ``videos`` videos (:func:`decode_options`)."""
        return decode_options(self.vae, decode_timestep, decode_noise_scale, videos, key)

    # -- generation ------------------------------------------------------------------------------------------------

    def conditioning(self, positive: PromptEmbeds, negative: PromptEmbeds | None, rope: nn.Rope) -> dict:
        """The loop's text conditioning (``[negative; positive]`` when guided) in the activations' dtype, sharded, with
        the rotary tables."""
        text = positive if negative is None else positive.after(negative)
        arrays = self.shard({"embeds": text.embeds.astype(self.activations_dtype), "mask": text.mask})
        return {**arrays, "rope": jax.tree.map(jnp.asarray, rope)}

    def generate(self, positive: PromptEmbeds, negative: PromptEmbeds | None, *, shape, key: PRNGKeyArray,
                 num_inference_steps: int, timesteps=None, guidance_scale: float, guidance_rescale: float = 0.0,
                 frame_rate: float = DEFAULT_FRAME_RATE, decode_timestep=0.0, decode_noise_scale=None, latents=None,
                 image=None, output_type: str = "uint8", progress: bool = True):
        """Everything after the text encoder: the latents of ``shape`` (``[n, T, h, w, C]``; the given ``latents`` or
        drawn from ``key``) denoised and decoded. ``image``: image-to-video's arrays (:class:`LTXDenoiser`; its
        ``first_frame`` replaces the first latent frame of the start latents)."""
        decode = self.decode_options(decode_timestep, decode_noise_scale, shape[0], key)  # checked before the loop
        schedule = self.schedule(num_inference_steps, shape, timesteps)
        guidance = Guidance(guidance_scale, guidance_rescale, enabled=guidance_scale > 1)
        draws = noise_draws(key, shape)
        x = draws.noise if latents is None else given_array(latents, shape, "latents", LATENTS_LAYOUT)
        with self.timed("prepare"):
            grid = self.transformer.grid(*shape[1:4])
            cond = self.conditioning(positive, negative, grid_rope(self.transformer, grid, self.rope_scale(frame_rate)))
            if image is not None:
                cond.update({k: self.shard(v) if k == "first_frame" else v for k, v in image.items()})
                x = jnp.where(image["frame_mask"] > 0, x, image["first_frame"])
            x = jax.block_until_ready(self.shard(x))
        x = self.run_loop(LTXDenoiser(self.transformer, self.activations_dtype), self.scheduler, schedule.state, x,
                          cond, draws.loop_key, guidance=guidance, num_steps=schedule.num_steps, progress=progress)
        return self.finish(x, output_type, guided_by=f"guidance_scale (now {guidance_scale:g})" if guidance.enabled
                           else None, **decode)

    def video_shape(self, videos: int, num_frames: int, height: int | None, width: int | None):
        """The latents' shape ``[n, T, h, w, C]`` of ``videos`` videos (sizes defaulting to diffusers' 512 x 704)."""
        height, width = height or DEFAULT_SIZE[0], width or DEFAULT_SIZE[1]
        return self.video_latents_shape(videos, num_frames, height, width, self.latent_channels)

    @checked_call
    def __call__(self, prompt: str | Sequence[str] | None = None, *,
                 negative_prompt: str | Sequence[str] | None = None, height: int | None = None,
                 width: int | None = None, num_frames: int = DEFAULT_FRAMES, frame_rate: float = DEFAULT_FRAME_RATE,
                 num_inference_steps: int = 50, timesteps: Sequence[float] | None = None, guidance_scale: float = 3.0,
                 guidance_rescale: float = 0.0, num_videos_per_prompt: int = 1, seed: int | None = None,
                 key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None, prompt_attention_mask=None,
                 negative_prompt_embeds=None, negative_prompt_attention_mask=None,
                 decode_timestep: float | Sequence[float] = 0.0,
                 decode_noise_scale: float | Sequence[float] | None = None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, output_type: str = "uint8", progress: bool = True):
        """Videos for ``prompt`` with diffusers' ``LTXPipeline`` arguments: uint8 ``[n, num_frames, height, width,
        3]``, or the final latents ``[n, T, h, w, C]`` (channels-last, normalised) with ``output_type="latent"``.

        Args:
            prompt: What to generate.
            negative_prompt: What to steer away from (classifier-free guidance; default "").
            height: Height in pixels, a multiple of 32; default 512.
            width: Width in pixels, a multiple of 32; default 704.
            num_frames: Frames per video, 8k+1 (121 is 5 seconds at 24 fps).
            frame_rate: Frames per second the model is conditioned on (also the saved video's, unless --fps is
                given).
            num_inference_steps: Number of denoising steps.
            timesteps: A custom schedule of timesteps from 1000 down (the distilled models' recipes), instead of
                num_inference_steps' sigmas.
            guidance_scale: Classifier-free guidance scale; 1 or less turns guidance off (the distilled models).
            guidance_rescale: Rescale the guided prediction toward the text prediction's std (0 = off).
            num_videos_per_prompt: Videos per prompt.
            seed: Random seed (the same seed gives the same videos).
            latents: The initial noise ``[n, T, h, w, C]``, channels-last (an array).
            prompt_embeds: T5 embeddings ``[n, seq, 4096]`` instead of ``prompt``.
            prompt_attention_mask: Their attention mask ``[n, seq]`` (needed with prompt_embeds).
            negative_prompt_embeds: T5 embeddings of the negative prompt.
            negative_prompt_attention_mask: Their attention mask.
            decode_timestep: The timestep a timestep-conditioned VAE decodes at (0.9.1+; 0.03-0.05 recommended).
            decode_noise_scale: How much fresh noise is mixed into the latents before decoding (default:
                decode_timestep).
            max_sequence_length: T5's prompt length in tokens (padded to it).
            output_type: ``"uint8"`` frames, ``"np"`` (float32 in [0, 1]), ``"pil"`` (per video a list of PIL
                frames) or ``"latent"`` (channels-last latents).
            progress: Show a progress bar.
        """
        key = resolve_key(seed, key)
        positive, negative = self.prompts(
            num_videos_per_prompt, prompt=prompt, negative_prompt=negative_prompt, guided=guidance_scale > 1,
            prompt_embeds=prompt_embeds, prompt_attention_mask=prompt_attention_mask,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_prompt_attention_mask=negative_prompt_attention_mask, max_sequence_length=max_sequence_length)
        shape = self.video_shape(positive.embeds.shape[0], num_frames, height, width)
        return self.generate(positive, negative, shape=shape, key=key, num_inference_steps=num_inference_steps,
                             timesteps=timesteps, guidance_scale=guidance_scale, guidance_rescale=guidance_rescale,
                             frame_rate=frame_rate, decode_timestep=decode_timestep,
                             decode_noise_scale=decode_noise_scale, latents=latents, output_type=output_type,
                             progress=progress)


def shift_mu(scheduler, shape) -> float | None:
    """diffusers' ``mu`` for latents of ``shape`` (``[n, T, h, w, C]``: ``T * h * w`` tokens) when ``scheduler`` takes
    one (used where it shifts dynamically)."""
    takes = getattr(scheduler, "SCHEDULE_KEYWORDS", ())
    if "mu" not in takes or not hasattr(scheduler, "dynamic_shift_mu"):
        return None
    return scheduler.dynamic_shift_mu(int(np.prod(shape[1:4])))


def schedule_for(scheduler, num_inference_steps: int | None, shape, timesteps=None):
    """``scheduler``'s plan: ``linspace(1, 1/N, N)`` sigmas (or the custom ``timesteps``), shifted by ``mu`` for
    latents of ``shape``."""
    mu = shift_mu(scheduler, shape)
    if timesteps is not None:
        return plan_schedule(scheduler, None, sample_shape=shape, timesteps=list(timesteps), mu=mu)
    takes = getattr(scheduler, "SCHEDULE_KEYWORDS", ())
    sigmas = (np.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps)
              if "sigmas" in takes and num_inference_steps else None)
    return plan_schedule(scheduler, num_inference_steps, sample_shape=shape, sigmas=sigmas, mu=mu)


def decode_options(vae, decode_timestep, decode_noise_scale, videos: int, key) -> dict:
    """The decoder keywords (:func:`decode_video`'s) of a call of ``videos`` videos: per-video ``timestep`` and
    ``noise_scale`` arrays (one value, or one per prompt or per video; the noise scale defaults to the timestep) for a
    timestep-conditioned decoder, and the call's ``key``."""
    if not vae.config.timestep_conditioning:
        return {"key": key}  # diffusers decodes without a timestep and mixes in no noise
    timestep = _per_video(decode_timestep, videos, "decode_timestep")
    scale = timestep if decode_noise_scale is None else _per_video(decode_noise_scale, videos, "decode_noise_scale")
    return {"timestep": to_device(timestep), "noise_scale": to_device(scale), "key": key}


def check_frame_rate(frame_rate) -> None:
    if isinstance(frame_rate, bool) or not isinstance(frame_rate, (int, float, np.integer, np.floating)) \
            or not 0 < frame_rate < float("inf"):
        raise InputError(f"frame_rate={frame_rate!r} must be a positive number of frames per second (25 is "
                         "LTX-Video's default, 24 or 30 its usual rates)")


def _per_video(value, videos: int, name: str) -> np.ndarray:
    """``value`` (one number, or one per prompt or per video) as float32 ``[videos]``."""
    values = np.asarray(value, np.float32).reshape(-1)
    if values.size == 1 or (values.size and videos % values.size == 0):
        return np.repeat(values, videos // values.size)
    raise InputError(f"{name} has {values.size} values for {videos} videos; pass one, or one per prompt")
