"""Flux.1 text-to-image, with distilled guidance or true CFG; the pipelines taking an image (image-to-image,
Kontext editing) build on it in :mod:`eqxdiff.pipelines.flux_image`.

>>> pipe = eqxdiff.load_pipeline("black-forest-labs/FLUX.1-dev", dtype="bfloat16")
>>> images = pipe("a fox in the snow", num_inference_steps=28, guidance_scale=3.5)   # uint8 [1, 1024, 1024, 3]

**Prompts.** CLIP's pooled output (``prompt``, at most the tokenizer's 77 tokens) conditions the modulation; T5's
sequence (``prompt_2``, default ``prompt``; padded to ``max_sequence_length``, no attention mask, as diffusers) is
the text stream. ``prompt_embeds`` ``[n, seq, joint_attention_dim]`` with ``pooled_prompt_embeds``
``[n, pooled_projection_dim]`` replace the encoders.

**Guidance.** FLUX.1-dev is guidance-distilled: ``guidance_scale`` goes into the transformer (``guidance_embeds``),
one pass per step; schnell takes none. True classifier-free guidance runs when ``true_cfg_scale > 1`` and a
negative prompt (or negative embeddings) is given: two passes per step, ``neg + true_cfg_scale * (pos - neg)``
(:class:`~eqxdiff.pipelines.Guidance` in ``"separate"`` mode, each half with its own rotary tables).

**Latents.** The loop runs on packed 2x2 patches (:func:`eqxdiff.models.flux.pack_latents`); ``latents`` (the
initial noise) and ``output_type="latent"`` are unpacked and channels-last, ``[n, height/f, width/f, C]`` (``f``
the VAE's factor, ``C = transformer.in_channels / 4``). Sizes are multiples of ``2 * f`` (16 for FLUX.1).
Sigmas are ``linspace(1, 1/N, N)``, shifted by ``mu`` for the image's token count (dev) or statically (schnell).

**Single files.** ``eqxdiff.load_pipeline("flux1-dev.safetensors", config=FOLDER)`` reads Black Forest Labs'
transformer file (or a ComfyUI one under ``model.diffusion_model.``, with its VAE and text encoders if it holds
them) and the rest of the pipeline from ``config``: a diffusers Flux folder or Hub id. These layouts are data
(:data:`SINGLE_FILE_LAYOUTS`), read and written by the shared single-file code (``save_single_file(pipe, path)``
writes a ComfyUI all-in-one file).
"""

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray
from ..core import program
from ..loading import CheckpointError, formats
from ..loading.single_file import ClipText, Layout, LdmVae, Part
from ..models import flux
from ._arguments import as_list, given_array, prompt_list, resolve_key
from ._call import checked_call
from ._checks import CallLimits, InputError, InputWarning, check_output_type, image_size, pixel_size
from ._components import Component
from ._denoise import Denoiser, Guidance, plan_schedule
from ._inpaint import IMAGE_LATENTS, MASK, NOISE, blend_known_region
from ._latents import LatentPipeline, noise_draws
from ._text import tokenize
from ._textual_inversion import TextualInversionMixin

__all__ = ["MAX_SEQUENCE_LENGTH", "FluxDenoiser", "FluxPipeline", "TextConditioning", "clip_pooled", "image_size_error",
           "t5_embeddings"]

LATENTS_LAYOUT = "[n, height/f, width/f, C] (unpacked, channels-last; f = the VAE's factor, C = in_channels / 4)"
MAX_SEQUENCE_LENGTH = 512  # diffusers' limit on T5's prompt length
DEFAULT_SAMPLE_SIZE = 128  # diffusers' default_sample_size: 128 * f = 1024 pixels for FLUX.1
# ComfyUI's all-in-one Flux files: where they keep the models other than the transformer, and their layouts.
COMFY_CLIP_L = "text_encoders.clip_l.transformer."
COMFY_VAE = "vae."


# -- text encoders ------------------------------------------------------------------------------------------------


@program
def clip_pooled(text_encoder, input_ids: Int[Array, "batch seq"]) -> Float[Array, "batch embed"]:
    """CLIP's ``pooler_output`` (the end-of-text token's final state): Flux's pooled conditioning."""
    return text_encoder(input_ids).pooler_output


@program
def t5_embeddings(text_encoder, input_ids: Int[Array, "batch seq"]) -> Float[Array, "batch seq embed"]:
    """T5's ``last_hidden_state`` without an attention mask (the padding is encoded too, as diffusers does)."""
    return text_encoder(input_ids).last_hidden_state


@dataclasses.dataclass(frozen=True)
class TextConditioning:
    """One half of the conditioning: T5's sequence ``embeds`` ``[n, seq, joint]`` and CLIP's ``pooled`` ``[n, p]``."""

    embeds: Any
    pooled: Any

    def repeat(self, times: int) -> "TextConditioning":
        return TextConditioning(jnp.repeat(self.embeds, times, axis=0), jnp.repeat(self.pooled, times, axis=0))


# -- the model in the loop ----------------------------------------------------------------------------------------


class FluxDenoiser(Denoiser):
    """The Flux transformer in :func:`~eqxdiff.pipelines.denoise_loop`, on packed latents ``[b, seq, 4C]``.

    ``cond``: ``embeds`` (T5), ``pooled`` (CLIP), ``rope`` (the rotary tables of ``[text, image]``, built outside
    the loop from concrete ids), ``guidance`` (``[b]``, distilled models only); for Kontext ``reference`` (the
    reference image's packed latents, appended to the tokens; the output keeps the noisy tokens only); for the
    control and Fill pipelines ``control`` (the control image's, or the masked image's and the mask's, packed
    latents, appended to each token's channels); for inpainting the known region's arrays
    (:mod:`eqxdiff.pipelines._inpaint`, packed), blended back after each step. The
    model gets ``timestep / 1000`` in float32 (it multiplies by 1000 again, as diffusers' pipeline and model do;
    diffusers rounds both to the latents' dtype, eqxdiff keeps the scheduler's float32 timestep)."""

    transformer: flux.FluxTransformer2DModel

    def __call__(self, x, t, cond, *, step):
        tokens = x if "control" not in cond else jnp.concatenate([x, cond["control"].astype(x.dtype)], axis=-1)
        if "reference" in cond:
            tokens = jnp.concatenate([tokens, cond["reference"].astype(x.dtype)], axis=1)
        sigma = jnp.broadcast_to(t, (x.shape[0],)).astype(jnp.float32) / 1000  # the model embeds it from float32
        out = self.transformer(tokens, cond["embeds"], cond["pooled"], sigma, rope=cond["rope"],
                               guidance=cond.get("guidance"))
        return out[:, :x.shape[1]]

    def after_step(self, x, t, cond, *, step, scheduler, state, last):
        return blend_known_region(x, cond, scheduler=scheduler, state=state, last=last)


# -- sizes --------------------------------------------------------------------------------------------------------


def _nearest_multiple(value: int, factor: int) -> int:
    return max(factor, (value + factor // 2) // factor * factor)  # halves round up


def _size_error(name: str, value: int, factor: int) -> InputError:
    vae = factor // 2
    return InputError(f"{name}={value} must be a multiple of {factor} (the VAE downsamples by {vae} and Flux packs "
                      f"2x2 latent patches); the nearest valid {name} is {_nearest_multiple(value, factor)}")


def image_size_error(height: int, width: int, factor: int) -> InputError:
    nearest = pixel_size(_nearest_multiple(height, factor), _nearest_multiple(width, factor))
    return InputError(f"image has {pixel_size(height, width)} pixels, not multiples of {factor} (the VAE downsamples "
                      f"by {factor // 2} and Flux packs 2x2 latent patches); resize or crop it to {nearest} (eqxdiff "
                      "does not resize input images)")


# -- the pipelines ------------------------------------------------------------------------------------------------


class FluxPipeline(TextualInversionMixin, LatentPipeline):
    """Flux.1 text-to-image (diffusers' ``FluxPipeline`` folders: FLUX.1-dev, FLUX.1-schnell and their fine-tunes).

    Call it with diffusers' argument names; it returns uint8 images ``[n, height, width, 3]`` (``"np"``
    floats, ``"pil"`` images, or with ``output_type="latent"`` the final latents unpacked and
    channels-last). See the module docstring for the
    prompts, guidance and latents, and :class:`~eqxdiff.pipelines.DiffusionPipeline` for ``attention``,
    ``activations_dtype``, ``mesh``, ``rules`` and ``offload_encoders``.
    """

    CLASS_NAME: ClassVar[str] = "FluxPipeline"
    LATENT_NORM: ClassVar[str] = "shift"  # diffusers' Flux pipelines read shift_factor, never latents_mean / std
    LORA_FORMAT: ClassVar[str] = "eqxdiff.pipelines._lora_flux:FLUX"
    LORA_SCALE_ARGUMENT: ClassVar[str | None] = "joint_attention_kwargs"  # {"scale": s} (diffusers)
    COMPONENTS: ClassVar[tuple[Component, ...]] = (
        Component("scheduler", "diffusers", "scheduler"),
        Component("vae", "diffusers", classes=("AutoencoderKL",), scan=False),
        Component("text_encoder", "transformers", classes=("CLIPTextModel",), encoder=True),
        Component("tokenizer", "transformers", "tokenizer"),
        Component("text_encoder_2", "transformers", classes=("T5EncoderModel",), encoder=True),
        Component("tokenizer_2", "transformers", "tokenizer"),
        Component("transformer", "diffusers", classes=("FluxTransformer2DModel",)),
    )
    INDEX_EXTRAS: ClassVar = {"image_encoder": [None, None], "feature_extractor": [None, None]}
    # Kontext scales the requested size to max_area itself: any height/width is accepted there.
    RESCALES_SIZE: ClassVar[bool] = False
    INIT_IMAGE: ClassVar[str | None] = None  # text-to-image: no image argument
    # How many packed latents the transformer's input holds along its channels: the noisy ones (1), and a control
    # image's after them (2: FLUX.1-Canny-dev, -Depth-dev). (FLUX.1-Fill-dev's also hold the mask: its class says.)
    PACKED_INPUTS: ClassVar[int] = 1
    # -- sizes and limits ----------------------------------------------------------------------------------------

    @property
    def latent_channels(self) -> int:
        """Channels of the unpacked latents: the transformer's input channels over the 2x2 packing (and over the
        packed inputs it concatenates, :attr:`PACKED_INPUTS`)."""
        return self.transformer.config.in_channels // (4 * self.PACKED_INPUTS)

    @classmethod
    def transformer_in_channels(cls, latent_channels: int, vae_scale_factor: int) -> int:
        """The transformer's ``in_channels`` this class drives, for the VAE's ``latent_channels`` and factor."""
        return 4 * latent_channels * cls.PACKED_INPUTS

    @classmethod
    def runs_folder(cls, read_json) -> bool:
        """Whether the folder's transformer takes the input width this class gives it (Flux's tasks differ by it:
        text-to-image, control, Fill)."""
        transformer, vae = (cls.folder_config(read_json, name) for name in ("transformer", "vae"))
        if transformer is None or vae is None:
            return True
        return transformer.in_channels == cls.transformer_in_channels(vae.latent_channels, vae.downsample_factor)

    def default_size(self) -> tuple[int, int]:
        """diffusers' default ``(height, width)``: ``128 * f`` pixels each (1024 for FLUX.1)."""
        return (DEFAULT_SAMPLE_SIZE * self.vae_scale_factor,) * 2

    LIMIT_COMPONENTS: ClassVar[tuple[str, ...]] = ("vae",)

    @classmethod
    def limits_from(cls, vae) -> CallLimits:
        if vae is None:
            return CallLimits()
        f = vae.downsample_factor
        return CallLimits(size_factor=None if cls.RESCALES_SIZE else 2 * f,
                          native_size=(DEFAULT_SAMPLE_SIZE * f,) * 2)

    @classmethod
    def check_arguments(cls, arguments: Mapping[str, Any], limits: CallLimits = CallLimits()) -> None:
        """Flux's own arguments (``true_cfg_scale``, ``max_sequence_length`` up to 512, sizes in multiples of twice
        the VAE's factor, naming the nearest valid size), then the shared ones."""
        factor = limits.size_factor
        for name in ("height", "width"):
            value = arguments.get(name)
            if factor and isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % factor:
                raise _size_error(name, value, factor)
        start = cls.INIT_IMAGE
        size = image_size(arguments[start]) if start and arguments.get(start) is not None else None
        if factor and size is not None and (size[0] % factor or size[1] % factor):
            raise image_size_error(*size, factor)
        scale = arguments.get("true_cfg_scale")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale)):
            raise InputError(f"true_cfg_scale={scale!r} must be a finite number (1 turns true CFG off; 4 is usual "
                             "with a negative prompt)")
        length = arguments.get("max_sequence_length")
        if isinstance(length, int) and not isinstance(length, bool) and length > MAX_SEQUENCE_LENGTH:
            raise InputError(f"max_sequence_length={length} cannot be greater than {MAX_SEQUENCE_LENGTH} (T5's "
                             "prompt length in the Flux pipelines); pass at most 512")
        super().check_arguments(arguments, limits)

    def _check_model(self) -> None:
        """The components fit together: the VAE's latents packed are the transformer's input, T5's and CLIP's
        widths its text and pooled widths."""
        config, vae = self.transformer.config, self.vae.config.latent_channels
        takes = self.transformer_in_channels(vae, self.vae_scale_factor)
        if config.in_channels != takes:
            f2 = self.vae_scale_factor ** 2
            raise CheckpointError(
                f"the transformer takes {config.in_channels} input channels but the VAE's latents have {vae} (x4 "
                f"packed = {4 * vae}): {type(self).__name__} drives Flux transformers taking "
                f"{takes}. Text-to-image ones ({4 * vae}) run as FluxPipeline (or "
                f"FluxImg2ImgPipeline, FluxInpaintPipeline, FluxKontextPipeline), Canny and Depth ones ({8 * vae}: the "
                f"control image's latents too) as FluxControlPipeline, Fill ones ({8 * vae + 4 * f2}: the masked "
                f"image's latents and the {f2}-pixel mask patches too) as FluxFillPipeline")
        for name, width, field in (("text_encoder_2", "d_model", "joint_attention_dim"),
                                   ("text_encoder", "hidden_size", "pooled_projection_dim")):
            want = getattr(config, field)
            encoder = getattr(self, name, None)
            have = getattr(getattr(encoder, "config", None), width, want)
            if have != want:
                raise CheckpointError(f"{name} gives {have}-wide embeddings ({width}) but the transformer's {field} is "
                                      f"{want}: the components are not of one Flux pipeline")

    # -- prompts -------------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt, prompt_2=None, *, max_sequence_length: int = MAX_SEQUENCE_LENGTH
                      ) -> TextConditioning:
        """T5 embeddings of ``prompt_2`` (default ``prompt``) and CLIP's pooled embedding of ``prompt``."""
        for name in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):
            if getattr(self, name, None) is None:
                raise InputError(f"this pipeline has no {name}; pass prompt_embeds and pooled_prompt_embeds")
        prompts = prompt_list(prompt)
        prompts_2 = prompts if not prompt_2 else as_list(prompt_2, len(prompts), "prompt_2")  # diffusers: `or`
        ids = tokenize(self.tokenizer, self.maybe_convert_prompt(prompts, self.tokenizer),
                       vocab_size=self.text_encoder.config.vocab_size)
        pooled = clip_pooled(self.encoder("text_encoder"), self.shard(jnp.asarray(ids)))
        ids_2 = tokenize(self.tokenizer_2, self.maybe_convert_prompt(prompts_2, self.tokenizer_2),
                         max_length=max_sequence_length, vocab_size=self.text_encoder_2.config.vocab_size,
                         tokenizer_name="tokenizer_2", encoder_name="text_encoder_2",
                         fix=f"Shorten the prompt or raise max_sequence_length (at most {MAX_SEQUENCE_LENGTH})")
        embeds = t5_embeddings(self.encoder("text_encoder_2"), self.shard(jnp.asarray(ids_2)))
        return TextConditioning(embeds, pooled)

    def _given_embeddings(self, embeds, pooled, prefix: str) -> TextConditioning:
        config = self.transformer.config
        if pooled is None:
            raise InputError(f"{prefix}prompt_embeds needs {prefix}pooled_prompt_embeds (CLIP's pooled output, "
                             f"[n, {config.pooled_projection_dim}]) from the same prompts")
        embeds, pooled = jnp.asarray(embeds, jnp.float32), jnp.asarray(pooled, jnp.float32)
        if embeds.ndim != 3 or embeds.shape[-1] != config.joint_attention_dim:
            raise InputError(f"{prefix}prompt_embeds must be [n, seq, {config.joint_attention_dim}] (T5's width, the "
                             f"transformer's joint_attention_dim), got shape {embeds.shape}")
        if pooled.shape != (embeds.shape[0], config.pooled_projection_dim):
            raise InputError(f"{prefix}pooled_prompt_embeds must be [{embeds.shape[0]}, "
                             f"{config.pooled_projection_dim}] (CLIP's width, the transformer's "
                             f"pooled_projection_dim), got shape {pooled.shape}")
        return TextConditioning(embeds, pooled)

    def text_conditioning(self, prompt=None, prompt_2=None, negative_prompt=None, negative_prompt_2=None, *,
                          true_cfg_scale: float = 1.0, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
                          prompt_embeds=None, pooled_prompt_embeds=None, negative_prompt_embeds=None,
                          negative_pooled_prompt_embeds=None) -> tuple[TextConditioning, TextConditioning | None]:
        """``(positive, negative)``: the negative half only under true CFG (``true_cfg_scale > 1`` and a negative
        prompt or negative embeddings), as diffusers' ``encode_prompt`` twice."""
        if prompt_embeds is None:
            if prompt is None:
                raise InputError("pass prompt (or prompt_embeds with pooled_prompt_embeds)")
            positive = self.encode_prompt(prompt, prompt_2, max_sequence_length=max_sequence_length)
        else:
            if prompt is not None or prompt_2 is not None:
                raise InputError("pass prompt (and prompt_2) or prompt_embeds, not both")
            positive = self._given_embeddings(prompt_embeds, pooled_prompt_embeds, "")
        has_negative = negative_prompt is not None or (negative_prompt_embeds is not None
                                                       and negative_pooled_prompt_embeds is not None)
        if true_cfg_scale > 1 and not has_negative:
            warnings.warn(f"true_cfg_scale={true_cfg_scale} has no effect without negative_prompt (or "
                          "negative_prompt_embeds with negative_pooled_prompt_embeds): true CFG needs a negative",
                          InputWarning, stacklevel=3)
        if true_cfg_scale <= 1 or not has_negative:
            if has_negative:
                warnings.warn("the negative prompt is not used: true CFG runs only with true_cfg_scale > 1",
                              InputWarning, stacklevel=3)
            return positive, None
        n = positive.embeds.shape[0]
        if negative_prompt_embeds is None:
            negatives = as_list(negative_prompt, n, "negative_prompt")
            negatives_2 = None if not negative_prompt_2 else as_list(negative_prompt_2, n, "negative_prompt_2")
            negative = self.encode_prompt(negatives, negatives_2, max_sequence_length=max_sequence_length)
        else:
            if negative_prompt is not None or negative_prompt_2 is not None:
                raise InputError("pass negative_prompt or negative_prompt_embeds, not both")
            negative = self._given_embeddings(negative_prompt_embeds, negative_pooled_prompt_embeds, "negative_")
            if prompt_embeds is not None and negative.embeds.shape != positive.embeds.shape:
                raise InputError(f"negative_prompt_embeds has shape {negative.embeds.shape} but prompt_embeds "
                                 f"{positive.embeds.shape}; pass both from the same max_sequence_length")
        if negative.embeds.shape[0] != n:
            raise InputError(f"{negative.embeds.shape[0]} negative embeddings for {n} prompts; pass one per prompt")
        return positive, negative

    # -- generation ------------------------------------------------------------------------------------------------

    def schedule_keywords(self, num_inference_steps: int, sigmas, image_seq_len: int) -> dict:
        """The scheduler's ``init`` keywords as diffusers' Flux pipelines pass them: ``sigmas`` (default
        ``linspace(1, 1/N, N)``, unless the scheduler makes flow sigmas itself) and ``mu`` for ``image_seq_len``
        tokens, for the schedulers that take them."""
        scheduler, takes = self.scheduler, self.scheduler.SCHEDULE_KEYWORDS
        if sigmas is None and "sigmas" in takes and not getattr(scheduler.config, "use_flow_sigmas", False):
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        mu = scheduler.dynamic_shift_mu(image_seq_len) if "mu" in takes and hasattr(scheduler,
                                                                                     "dynamic_shift_mu") else None
        return {"sigmas": None if sigmas is None else list(sigmas), "mu": mu}

    def generate(self, positive: TextConditioning, negative: TextConditioning | None, *, batch: int, height: int,
                 width: int, num_inference_steps: int, sigmas, guidance_scale: float, true_cfg_scale: float,
                 key: PRNGKeyArray, latents=None, image=None, strength: float | None = None, reference=None,
                 control=(), mask=None, output_type: str = "uint8", progress: bool = True):
        """Everything after the text encoders. ``positive`` / ``negative``: the text conditioning of ``batch``
        rows (``negative`` only under true CFG). ``latents``: the initial noise (:data:`LATENTS_LAYOUT`), else drawn
        from ``key``. ``image`` (image-to-image): the input's latents ``[batch, h, w, C]``, noised to ``strength``
        with that noise. ``reference`` (Kontext): the reference image's latents, appended as tokens. ``control``
        (the control and Fill pipelines): arrays ``[batch, h, w, *]`` (the control image's latents; the masked
        image's latents and the mask's pixel patches), each packed and appended to the channels in turn. ``mask``
        (inpainting, with ``image``): the latent mask ``[batch, h, w, 1]`` (1 = repaint); outside it ``image``
        noised to the next step (clean after the last) is blended back after every step."""
        check_output_type(output_type)
        self._check_model()
        f, c = self.vae_scale_factor, self.latent_channels
        h, w = height // f, width // f
        shape = (batch, h, w, c)
        packed_shape = (batch, (h // 2) * (w // 2), 4 * c)
        schedule = plan_schedule(self.scheduler, num_inference_steps, sample_shape=packed_shape,
                                 strength=None if image is None else strength,
                                 **self.schedule_keywords(num_inference_steps, sigmas, packed_shape[1]))
        draws = noise_draws(key, shape)
        noise = draws.noise if latents is None else given_array(latents, shape, "latents", LATENTS_LAYOUT)
        dtype = self.activations_dtype

        with self.timed("prepare"):
            x = noise if image is None else self.scheduler.add_noise_at_step(schedule.state, image, noise)
            x = flux.pack_latents(x)
            ids = flux.image_ids(h // 2, w // 2)
            extra = {}
            if self.transformer.config.guidance_embeds:
                extra["guidance"] = jnp.full((batch,), guidance_scale, jnp.float32)
            if reference is not None:
                extra["reference"] = flux.pack_latents(reference).astype(dtype)
                reference_ids = flux.image_ids(reference.shape[1] // 2, reference.shape[2] // 2)
                reference_ids[:, 0] = 1  # Kontext: the reference image's tokens sit at time index 1
                ids = np.concatenate([ids, reference_ids])
            if len(control):
                extra["control"] = jnp.concatenate([flux.pack_latents(c) for c in control], -1).astype(dtype)
            if mask is not None:
                arrays = (jnp.broadcast_to(mask, shape), image, noise)
                extra.update(zip((MASK, IMAGE_LATENTS, NOISE), (flux.pack_latents(a).astype(dtype) for a in arrays)))

            def half(text: TextConditioning) -> dict:
                rope = self.transformer.rotary_embedding(ids, flux.text_ids(text.embeds.shape[1]))
                arrays = {"embeds": text.embeds.astype(dtype), "pooled": text.pooled.astype(dtype), **extra}
                return {**self.shard(arrays), "rope": jax.tree.map(jnp.asarray, rope)}

            guidance = Guidance(float(true_cfg_scale), mode="separate") if negative is not None else Guidance(1.0)
            cond = (half(negative), half(positive)) if negative is not None else half(positive)
            x = jax.block_until_ready(self.shard(x.astype(dtype)))

        x = self.run_loop(FluxDenoiser(self.transformer), self.scheduler, schedule.state, x, cond, draws.loop_key,
                          guidance=guidance, num_steps=schedule.num_steps, progress=progress)
        return self.finish(flux.unpack_latents(x, h, w), output_type,
                           guided_by=f"true_cfg_scale (now {true_cfg_scale:g})" if guidance.enabled else None)

    def _prepare(self, call: Mapping[str, Any]) -> tuple[TextConditioning, TextConditioning | None, int]:
        """The text conditioning of every output row (``num_images_per_prompt`` rows per prompt) and their number,
        from a Flux call's arguments (its ``locals()``; a class whose call takes no negative prompts or
        ``true_cfg_scale``, as diffusers' Control and Fill pipelines, has true CFG off)."""
        self._check_model()
        with self.timed("encode"):
            positive, negative = self.text_conditioning(
                call["prompt"], call["prompt_2"], call.get("negative_prompt"), call.get("negative_prompt_2"),
                true_cfg_scale=call.get("true_cfg_scale", 1.0), max_sequence_length=call["max_sequence_length"],
                prompt_embeds=call["prompt_embeds"], pooled_prompt_embeds=call["pooled_prompt_embeds"],
                negative_prompt_embeds=call.get("negative_prompt_embeds"),
                negative_pooled_prompt_embeds=call.get("negative_pooled_prompt_embeds"))
            positive = positive.repeat(call["num_images_per_prompt"])
            negative = None if negative is None else negative.repeat(call["num_images_per_prompt"])
        return positive, negative, positive.embeds.shape[0]

    def _generate(self, call: Mapping[str, Any], text: tuple, size: tuple[int, int], key: PRNGKeyArray, **inputs):
        """:meth:`generate` for a Flux call (its ``locals()``: the loop's arguments as given), ``text`` from
        :meth:`_prepare`, the output ``size`` and the call's image ``inputs`` (``image``, ``strength``, ``mask``,
        ``reference``, ``control``)."""
        positive, negative, n = text
        return self.generate(positive, negative, batch=n, height=size[0], width=size[1],
                             num_inference_steps=call["num_inference_steps"], sigmas=call["sigmas"],
                             guidance_scale=call["guidance_scale"], true_cfg_scale=call.get("true_cfg_scale", 1.0),
                             key=key, latents=call["latents"], output_type=call["output_type"],
                             progress=call["progress"], **inputs)

    @checked_call
    def __call__(self, prompt: str | Sequence[str] | None = None, prompt_2: str | Sequence[str] | None = None, *,
                 negative_prompt: str | Sequence[str] | None = None,
                 negative_prompt_2: str | Sequence[str] | None = None, true_cfg_scale: float = 1.0,
                 height: int | None = None, width: int | None = None, num_inference_steps: int = 28,
                 sigmas: Sequence[float] | None = None, guidance_scale: float = 3.5, num_images_per_prompt: int = 1,
                 seed: int | None = None, key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None,
                 pooled_prompt_embeds=None, negative_prompt_embeds=None, negative_pooled_prompt_embeds=None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, output_type: str = "uint8", progress: bool = True):
        """Images for ``prompt`` with diffusers' ``FluxPipeline`` arguments: uint8 ``[n, height, width, 3]``, or the
        final latents (unpacked, channels-last) with ``output_type="latent"``.

        Args:
            prompt: What to generate (CLIP's prompt; T5's too unless ``prompt_2`` is given).
            prompt_2: T5's prompt (default: ``prompt``).
            negative_prompt: What to steer away from, with true CFG (``true_cfg_scale > 1``).
            negative_prompt_2: T5's negative prompt (default: ``negative_prompt``).
            true_cfg_scale: True classifier-free guidance scale: two model passes a step when > 1 and a negative
                prompt is given.
            height: Height in pixels, a multiple of 16 (2x the VAE's factor); default 1024.
            width: Width in pixels, a multiple of 16 (2x the VAE's factor); default 1024.
            num_inference_steps: Number of denoising steps (4 suits schnell, 28-50 dev).
            sigmas: A custom noise-level schedule from 1 down (replaces num_inference_steps' linspace(1, 1/N, N)).
            guidance_scale: The distilled guidance the transformer is conditioned on (models with guidance_embeds,
                e.g. FLUX.1-dev; 3.5 is usual); ignored by others.
            num_images_per_prompt: Images per prompt.
            seed: Random seed (the same seed gives the same images).
            latents: The initial noise ``[n, height/f, width/f, C]``, unpacked and channels-last (an array).
            prompt_embeds: T5 embeddings ``[n, seq, joint_attention_dim]`` instead of ``prompt``.
            pooled_prompt_embeds: CLIP's pooled embeddings ``[n, pooled_projection_dim]`` with ``prompt_embeds``.
            negative_prompt_embeds: T5 embeddings of the negative prompt (true CFG).
            negative_pooled_prompt_embeds: CLIP's pooled embeddings of the negative prompt (true CFG).
            max_sequence_length: T5's prompt length in tokens (padded to it; at most 512).
            output_type: ``"uint8"`` images, ``"np"`` (float32 in [0, 1]), ``"pil"`` (a list of PIL
                images) or ``"latent"`` (unpacked, channels-last latents).
            progress: Show a progress bar.
        """
        key = resolve_key(seed, key)
        text = self._prepare(locals())
        default = self.default_size()
        size = default[0] if height is None else height, default[1] if width is None else width
        return self._generate(locals(), text, size, key)


# -- single files: Black Forest Labs' transformer files and ComfyUI's all-in-one files, as layouts ------------------

_SINGLE_FILE = dict(family="Flux", pipelines=("FluxPipeline", "FluxImg2ImgPipeline", "FluxKontextPipeline",
                                              "FluxControlPipeline", "FluxInpaintPipeline", "FluxFillPipeline"),
                    tokenizers={"tokenizer": "text_encoder", "tokenizer_2": "text_encoder_2"},
                    hub_id="black-forest-labs/FLUX.1-schnell")
# The layouts eqxdiff.load_pipeline(file, config=FLUX_FOLDER) reads (listed in eqxdiff.core.SINGLE_FILE_LAYOUTS): the
# transformer in BFL's names, its sizes read from the tensors unless config= holds transformer/config.json; ComfyUI's
# files keep it under model.diffusion_model. and may hold the VAE (LDM layout), CLIP-L and T5 (transformers' names),
# whose configs come from config=. What a file lacks comes from config= (a Hub id: the weights it lacks are fetched);
# its model_index.json may name Img2Img or Kontext.
SINGLE_FILE_LAYOUTS = (
    Layout(name="flux_bfl", signature=("img_in.weight", "txt_in.weight"),
           parts=(formats.BflTransformer(prefix=""),), **_SINGLE_FILE),
    Layout(name="flux_comfyui", signature=(formats.FLUX_DIFFUSION_MODEL + "img_in.weight",
                                             formats.FLUX_DIFFUSION_MODEL + "txt_in.weight"),
           parts=(formats.BflTransformer(prefix=formats.FLUX_DIFFUSION_MODEL),
                  LdmVae(prefix=COMFY_VAE, optional=True, infer_config=False),
                  ClipText(name="text_encoder", prefix=COMFY_CLIP_L, optional=True, infer_config=False),
                  Part(name="text_encoder_2", model_class="T5EncoderModel", prefix=formats.COMFY_T5XXL,
                       optional=True)),
           **_SINGLE_FILE),
)
