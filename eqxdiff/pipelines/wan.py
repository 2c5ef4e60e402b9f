"""Wan 2.1 / 2.2 text-to-video (diffusers' ``WanPipeline`` folders: Wan2.1-T2V-1.3B/14B, Wan2.2-T2V-A14B with its two
experts, Wan2.2-TI2V-5B); image-to-video builds on it in :mod:`eqxdiff.pipelines.wan_i2v`.

>>> pipe = eqxdiff.load_pipeline("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", dtype="bfloat16")
>>> video = pipe("a cat surfing a wave", num_frames=81, guidance_scale=5.0)    # uint8 [1, 81, 480, 832, 3]

**Prompts.** Cleaned as diffusers does (``ftfy`` if installed, HTML entities, whitespace), tokenized to
``max_sequence_length`` (512) with the attention mask (:mod:`eqxdiff.pipelines._text`), encoded by UMT5 with that
mask, and every position past a prompt's end set to zero (diffusers' trim and zero padding). Classifier-free
guidance runs when ``guidance_scale > 1``, the negative prompt defaulting to ``""`` (encoded at
``max_sequence_length``, as diffusers encodes it, beside ``prompt_embeds`` too), both halves in one batch; where the
two differ in length (``prompt_embeds`` or ``negative_prompt_embeds`` of another length) they run apart, two model
calls per step, as diffusers' two calls do. ``prompt_embeds`` / ``negative_prompt_embeds`` ``[n, seq, text_dim]``
replace the encoder, each row repeated per video as prompts are (diffusers repeats none: several rows fail with
``num_videos_per_prompt > 1``). The prompts' cross-attention keys and values (``cross_attention_kv``): once per call.

**Two experts (Wan 2.2 A14B).** With ``boundary_ratio`` (the folder's, or the call's) the steps whose timestep is at
least ``boundary_ratio * num_train_timesteps`` run ``transformer`` (high noise) with ``guidance_scale``, the others
``transformer_2`` (low noise) with ``guidance_scale_2`` (default ``guidance_scale``). The expert is chosen inside
the one compiled loop (a ``lax.cond`` on a per-step flag) and the guidance scale is a per-step array, so a new
``boundary_ratio``, ``guidance_scale_2`` or step count compiles nothing. Both experts stay on the devices by
default; with ``offload_experts`` (:meth:`WanPipeline.enable_expert_offload`) they live in host memory and only the
active one is on the devices: the loop then runs in two segments (the same compiled program, the scheduler's state
carried over), and each call copies each expert's weights to the devices once (A14B in bfloat16: 28 GB per
expert, one to a few seconds at PCIe's 10-50 GB/s, against minutes of denoising; not measured here) and computes its
cross-attention keys and values then, while the devices hold half the weights. Offloading gathers the experts to
one host's memory: single-host meshes only.

**Latents** are unpacked and channels-last, ``[n, T, h, w, C]`` with ``T = (num_frames - 1) / 4 + 1`` and
``h, w`` the size over the VAE's factor (8; 16 for the 2.2 VAE); ``num_frames`` is ``4k + 1``, heights and widths
multiples of the VAE's factor times the transformer's patch (16; 32 for TI2V-5B). ``expand_timesteps`` folders
(TI2V-5B) give every video token its own timestep; in text-to-video all are the step's, which is the same as one per
sample (computed so). The output is uint8 frames ``[n, num_frames, height, width, 3]`` (``eqxdiff-generate`` saves
them as MP4); ``enable_vae_tiling()`` decodes in spatial tiles and one latent frame at a time (and image-to-video
encodes its condition video in tiles, as diffusers' ``vae.enable_tiling()`` does).

**Original checkpoints.** ``eqxdiff.load_pipeline("wan2.1_t2v_1.3B_bf16.safetensors", config=FOLDER)`` reads a Wan-AI
transformer file in the original names (or ComfyUI's under ``model.diffusion_model.``; an original VAE file the same
way), its config from the tensors unless ``config`` holds ``transformer/config.json``, and the rest of the pipeline
from ``config`` (a diffusers Wan folder or Hub id): the layouts are data (:data:`SINGLE_FILE_LAYOUTS`). One model
alone: ``eqxdiff.load(file, config=...)`` (sharded original files: their folder). **LoRA files** of every Wan trainer
(``pipe.load_lora_weights``): :mod:`eqxdiff.pipelines._lora_wan`.
"""

import html
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray
from ..core import program
from ..loading import formats
from ..loading.single_file import Layout, Sized
from ..models.wan import WanTransformer3DModel
from ..parallel import shard_params
from ._arguments import given_array, prompt_list, resolve_key
from ._call import checked_call
from ._checks import CallLimits, InputError
from ._components import Component
from ._denoise import Denoiser, Guidance, denoise_loop, plan_schedule
from ._latents import LatentPipeline, noise_draws
from ._progress import progress_bar
from ._text import prompt_pair, tokens, zero_padding
from ._wan_experts import expert_boundary

try:  # diffusers cleans prompts with ftfy when it is installed: so do we, to read the same prompts
    import ftfy
except ImportError:  # pragma: no cover - depends on the environment
    ftfy = None

__all__ = ["MAX_SEQUENCE_LENGTH", "WanDenoiser", "WanPipeline", "clean_prompt", "cross_attention_kv",
           "umt5_embeddings"]

MAX_SEQUENCE_LENGTH = 512  # diffusers' default prompt length (and what 2.1 image-to-video's added k/v assume)
DEFAULT_SIZE = (480, 832)
DEFAULT_FRAMES = 81
# diffusers' Wan video-to-video rounds strength to whole steps (get_timesteps: N - int(N * strength) skipped) whatever
# the scheduler (a FlowMatchEuler scheduler's own default is Flux's int(N - N * strength))
STRENGTH_WHOLE_STEPS = True
LATENTS_LAYOUT = "[n, (num_frames - 1) / t + 1, height/f, width/f, C] (channels-last; t, f: the VAE's factors)"


# -- prompts ------------------------------------------------------------------------------------------------------


def clean_prompt(text: str) -> str:
    """diffusers' ``prompt_clean``: ``ftfy.fix_text`` (if installed), HTML entities unescaped twice, whitespace runs
    made one space, the ends stripped."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


@program
def umt5_embeddings(text_encoder, input_ids: Int[Array, "batch seq"], mask: Int[Array, "batch seq"]
                    ) -> Float[Array, "batch seq embed"]:
    """UMT5's ``last_hidden_state`` with the attention mask, zero past each prompt's end (diffusers' Wan)."""
    return zero_padding(text_encoder(input_ids, attention_mask=mask).last_hidden_state, mask)


@program
def cross_attention_kv(transformer, embeds, image_embeds=None, *, dtype=jnp.float32):
    """The transformer's cross-attention keys and values of the prompts (and image tokens), computed once per call
    and reused at every step (:meth:`~eqxdiff.models.wan.WanTransformer3DModel.cross_attention_kv`)."""
    image = None if image_embeds is None else image_embeds.astype(dtype)
    return transformer.cross_attention_kv(embeds.astype(dtype), image, dtype=dtype)


# -- the model in the loop ----------------------------------------------------------------------------------------


class WanDenoiser(Denoiser):
    """The Wan transformer(s) in :func:`~eqxdiff.pipelines.denoise_loop` on latents ``[b, T, h, w, C]`` (float32;
    the model runs in ``dtype``).

    ``cond``: ``kv`` (the cross-attention keys and values of ``transformer``); with ``transformer_2``, ``kv_2`` and
    ``high_noise`` (a flag per step of the padded schedule: ``transformer`` runs where it is set). Image-to-video
    adds ``condition`` (mask and image latents, concatenated after the latents' channels) or, with per-token
    timesteps (TI2V), ``first_frame`` (the image's latents), ``frame_mask`` (0 on the first latent frame, 1 after)
    and ``token_mask`` (the same per video token: the model's timestep is ``token_mask * t``)."""

    transformer: WanTransformer3DModel
    transformer_2: WanTransformer3DModel | None = None
    dtype: Any = eqx.field(static=True, default=jnp.float32)

    def __call__(self, x, t, cond, *, step):
        x_in, timestep = model_input(x, t, cond)
        x_in = x_in.astype(self.dtype)
        if self.transformer_2 is None:
            return self.transformer(x_in, timestep, cross_kv=cond["kv"])
        return jax.lax.cond(cond["high_noise"][step],
                            lambda: self.transformer(x_in, timestep, cross_kv=cond["kv"]),
                            lambda: self.transformer_2(x_in, timestep, cross_kv=cond["kv_2"]))


def token_mask(frame_mask, patch_size) -> Array:
    """``frame_mask`` ``[n, T, h, w, 1]`` (constant over each of the transformer's ``patch_size`` patches) per video
    token, ``[n, tokens]`` in the transformer's token order: TI2V's timestep factor (0 on the first frame's tokens)."""
    pt, ph, pw = patch_size
    return frame_mask[:, ::pt, ::ph, ::pw, 0].reshape(frame_mask.shape[0], -1)


def model_input(x, t, cond):
    """``(latents, timestep)`` as the transformer takes them: image-to-video's condition channels appended, or the
    first frame's latents blended in with one timestep per token (TI2V); else the latents and ``t`` per sample."""
    if "condition" in cond:
        x = jnp.concatenate([x, cond["condition"].astype(x.dtype)], axis=-1)
    if "first_frame" not in cond:
        return x, jnp.broadcast_to(t, (x.shape[0],))
    m = cond["frame_mask"].astype(x.dtype)
    x = (1 - m) * cond["first_frame"].astype(x.dtype) + m * x
    return x, cond["token_mask"] * t.astype(jnp.float32)


# -- the pipeline -------------------------------------------------------------------------------------------------


class WanPipeline(LatentPipeline):
    """Wan text-to-video (diffusers' ``WanPipeline``): uint8 frames ``[n, num_frames, height, width, 3]`` from
    prompts, with diffusers' argument names. See the module docstring for prompts, the two experts and the latents,
    and :class:`~eqxdiff.pipelines.DiffusionPipeline` for ``attention``, ``activations_dtype``, ``mesh``, ``rules``
    and ``offload_encoders``; ``offload_experts`` keeps the transformers in host memory
    (:meth:`enable_expert_offload`)."""

    CLASS_NAME: ClassVar[str] = "WanPipeline"
    COMPONENTS: ClassVar[tuple[Component, ...]] = (
        Component("tokenizer", "transformers", "tokenizer"),
        Component("text_encoder", "transformers", classes=("UMT5EncoderModel", "T5EncoderModel"), encoder=True),
        Component("vae", "diffusers", classes=("AutoencoderKLWan",), scan=False),
        Component("scheduler", "diffusers", "scheduler"),
        Component("transformer", "diffusers", classes=("WanTransformer3DModel",)),
        Component("transformer_2", "diffusers", classes=("WanTransformer3DModel",), optional=True),
    )
    # model_index.json settings: the 2.2 A14B expert boundary (None: one transformer), TI2V's per-token timesteps
    OPTIONS: ClassVar = {"boundary_ratio": None, "expand_timesteps": False}
    SETTINGS: ClassVar[tuple[str, ...]] = (*LatentPipeline.SETTINGS, "offload_experts")
    INIT_IMAGE: ClassVar[str | None] = None  # text-to-video: no image argument
    LORA_FORMAT: ClassVar[str | None] = "eqxdiff.pipelines._lora_wan:WAN"
    LORA_SCALE_ARGUMENT: ClassVar[str | None] = "attention_kwargs"  # {"scale": s} (diffusers)

    def __init__(self, *, offload_experts: bool = False, **components_and_options):
        super().__init__(**components_and_options)
        self._offload_experts = False
        if offload_experts:
            self.enable_expert_offload()

    def load_lora_weights(self, path_or_hub_id, *, load_into_transformer_2: bool = False, **kwargs) -> str:
        """:meth:`LoraMixin.load_lora_weights <eqxdiff.pipelines.LoraMixin.load_lora_weights>`, with diffusers' Wan
        keyword: ``load_into_transformer_2=True`` loads the file into ``transformer_2`` (Wan 2.2 A14B's low-noise
        expert) instead of ``transformer``, as the two-expert LoRAs (Wan2.2-Lightning's high / low noise files) are
        loaded: one file per expert, each its own adapter name."""
        if load_into_transformer_2 and getattr(self, "transformer_2", None) is None:
            raise ValueError(f"load_into_transformer_2=True: this {type(self).__name__} has no transformer_2 (only a "
                             "Wan 2.2 A14B folder has the second expert); load the file into transformer")
        return super().load_lora_weights(path_or_hub_id, into={"transformer": "transformer_2"}
                                          if load_into_transformer_2 else None, **kwargs)

    # -- experts on the devices or in host memory ------------------------------------------------------------

    @property
    def offload_experts(self) -> bool:
        """Whether the transformers live in host memory, each on the devices only while its steps run."""
        return self._offload_experts

    @offload_experts.setter
    def offload_experts(self, enabled: bool) -> None:
        self.enable_expert_offload(enabled)

    def enable_expert_offload(self, enabled: bool = True) -> None:
        """Keep ``transformer`` and ``transformer_2`` in host memory and put each on the devices only for its own
        steps (the module docstring gives the cost); ``False`` places both on the devices again."""
        for name in ("transformer", "transformer_2"):
            model = getattr(self, name, None)
            if model is not None:
                setattr(self, name, jax.device_get(model) if enabled else self.on_devices(model))
        self._offload_experts = bool(enabled)

    def on_devices(self, model):
        """``model`` on the devices: sharded by the rules on the pipeline's mesh, else on the default device."""
        return jax.tree.map(jnp.asarray, model) if self.mesh is None else shard_params(model, self.mesh, self.rules)

    # -- sizes and limits ----------------------------------------------------------------------------------------

    @property
    def latent_channels(self) -> int:
        """Channels of the latents the scheduler steps: the transformer's input (text-to-video)."""
        return self.transformer.config.in_channels

    @property
    def default_fps(self) -> int:
        """The frame rate the checkpoint's videos play at (saved videos): 24 for TI2V-5B, else 16."""
        return 24 if self.expand_timesteps else 16

    LIMIT_COMPONENTS: ClassVar[tuple[str, ...]] = ("vae", "transformer")

    @classmethod
    def limits_from(cls, vae, transformer) -> CallLimits:
        patch = (1, 1, 1) if transformer is None else transformer.patch_size
        return CallLimits.of_patches(vae, patch[1:], native_size=DEFAULT_SIZE)

    def check_call(self, arguments) -> None:
        """The schedule exists for the steps asked for (and leaves a step after video-to-video's ``strength``); the
        experts' arguments fit the folder (``eqxdiff-generate``'s stand-in holds its ``folder_index``)."""
        if "num_inference_steps" in arguments:
            plan_schedule(self.scheduler, arguments["num_inference_steps"], sample_shape=(1, 1, 1, 1, 1),
                          strength=arguments.get("strength"), whole_steps=STRENGTH_WHOLE_STEPS,  # video-to-video's
                          timesteps=arguments.get("timesteps"))
        index = getattr(self, "folder_index", None)  # eqxdiff-generate's stand-in: the folder's model_index.json
        if index is None and not hasattr(self, "transformer"):
            return
        second = getattr(self, "transformer_2", None) if index is None else index.get("transformer_2")
        two = second[-1] is not None if isinstance(second, (list, tuple)) else second is not None
        ratio = (self.boundary_ratio if index is None else index.get("boundary_ratio")) \
            if arguments.get("boundary_ratio") is None else arguments["boundary_ratio"]
        expert_boundary(ratio, two, arguments.get("guidance_scale_2"))

    # -- prompts -------------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt, *, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> Array:
        """UMT5 embeddings ``[n, max_sequence_length, text_dim]`` of ``prompt`` (one string or several), cleaned,
        masked and zero-padded as diffusers does."""
        for name in ("tokenizer", "text_encoder"):
            if getattr(self, name, None) is None:
                raise InputError(f"this pipeline has no {name}; pass prompt_embeds (and negative_prompt_embeds)")
        prompts = [clean_prompt(p) for p in prompt_list(prompt)]
        ids = tokens(self.tokenizer, prompts, max_length=max_sequence_length,
                     vocab_size=self.text_encoder.config.vocab_size,
                     fix="Shorten the prompt or raise max_sequence_length")
        arrays = self.shard({"ids": jnp.asarray(ids.ids), "mask": jnp.asarray(ids.mask)})
        return umt5_embeddings(self.encoder("text_encoder"), arrays["ids"], arrays["mask"])

    def _given(self, embeds, name: str) -> Array:
        dim = self.transformer.config.text_dim
        embeds = jnp.asarray(embeds, jnp.float32)
        if embeds.ndim != 3 or embeds.shape[-1] != dim:
            raise InputError(f"{name} must be [n, seq, {dim}] (UMT5's width, the transformer's text_dim), got shape "
                             f"{embeds.shape}")
        return embeds

    def text_conditioning(self, prompt=None, negative_prompt=None, *, guided: bool, prompt_embeds=None,
                          negative_prompt_embeds=None, max_sequence_length: int = MAX_SEQUENCE_LENGTH
                          ) -> tuple[Array, Array | None]:
        """``(positive, negative)`` embeddings, the negative only when ``guided``
        (:func:`~eqxdiff.pipelines._text.prompt_pair`)."""
        return prompt_pair(lambda prompts, length: self.encode_prompt(prompts, max_sequence_length=length),
                           self._given, prompt=prompt, negative_prompt=negative_prompt, prompt_embeds=prompt_embeds,
                           negative_prompt_embeds=negative_prompt_embeds, guided=guided,
                           max_sequence_length=max_sequence_length, shape=jnp.shape, same_length=False)

    def prompts(self, num_videos_per_prompt: int, *text, **options) -> tuple[Array, Array | None]:
        """:meth:`text_conditioning` with every row repeated for its videos, timed as ``encode``."""
        with self.timed("encode"):
            positive, negative = self.text_conditioning(*text, **options)
            return jnp.repeat(positive, num_videos_per_prompt, axis=0), None if negative is None else jnp.repeat(
                negative, num_videos_per_prompt, axis=0)

    # -- generation ------------------------------------------------------------------------------------------------

    def experts_schedule(self, num_inference_steps: int, shape, *, guidance_scale: float, guidance_scale_2,
                         boundary: float | None, strength: float | None = None, timesteps=None):
        """``(schedule, guidance, high_noise)``: the scheduler's plan (cut by ``strength``, video-to-video), the
        (per-step, with two experts) guidance and the per-step expert flags (``None`` with one expert), both as long
        as the padded schedule; ``timesteps``: a custom schedule (diffusers' ``timesteps``)."""
        schedule = plan_schedule(self.scheduler, num_inference_steps, sample_shape=shape, strength=strength,
                                 whole_steps=STRENGTH_WHOLE_STEPS, timesteps=timesteps)
        guided = guidance_scale > 1  # diffusers: guidance_scale alone decides, also for the low-noise expert
        if boundary is None:
            return schedule, Guidance(guidance_scale, enabled=guided), None
        timesteps = np.asarray(schedule.state.timesteps)
        # diffusers compares the timestep tensor with boundary_ratio * T in float32
        high = timesteps.astype(np.float32) >= np.float32(boundary * self.scheduler.config.num_train_timesteps)
        second = guidance_scale if guidance_scale_2 is None else guidance_scale_2
        scale = np.where(high, guidance_scale, second).astype(np.float32)
        return schedule, Guidance(scale, enabled=guided), high

    def generate(self, positive, negative, *, shape, num_inference_steps: int, guidance_scale: float,
                 guidance_scale_2, boundary_ratio, key: PRNGKeyArray, latents=None, extra=None, image_embeds=None,
                 init_latents=None, strength: float | None = None, timesteps=None, output_type: str = "uint8",
                 progress: bool = True):
        """Everything after the text encoders: the latents of ``shape`` (``[n, T, h, w, C]``; the noise given as
        ``latents`` or drawn from ``key``) denoised and decoded. ``extra``: image-to-video's conditioning arrays
        (:class:`WanDenoiser`), one row per video where they have rows (:data:`BATCHED`); ``image_embeds``: CLIP's
        image tokens (2.1 image-to-video), one image's (or first-last pair's) rows per video. ``init_latents``
        (video-to-video, ``shape``): the start, noised to the first step the schedule keeps of ``strength``
        (:func:`~eqxdiff.pipelines.plan_schedule`, ``add_noise_at_step``), instead of the noise alone; ``timesteps``
        a custom schedule in place of ``num_inference_steps`` (for schedulers that take one)."""
        boundary = expert_boundary(self.boundary_ratio if boundary_ratio is None else boundary_ratio,
                                    getattr(self, "transformer_2", None) is not None)
        schedule, guidance, high = self.experts_schedule(num_inference_steps, shape, guidance_scale=guidance_scale,
                                                         guidance_scale_2=guidance_scale_2, boundary=boundary,
                                                         strength=None if init_latents is None else strength,
                                                         timesteps=timesteps)
        draws = noise_draws(key, shape)
        noise = draws.noise if latents is None else given_array(latents, shape, "latents", LATENTS_LAYOUT)
        start = noise if init_latents is None else self.scheduler.add_noise_at_step(schedule.state, init_latents,
                                                                                      noise)
        extra = self.shard(dict(extra or {}))
        # embeddings of two lengths (a negative at max_sequence_length beside prompt_embeds of another) cannot share
        # one batch: the two halves then run apart, two model calls, as diffusers' two calls do
        apart = negative is not None and negative.shape[1] != positive.shape[1]
        if apart:
            guidance = Guidance(guidance.scale, guidance.rescale, "separate", enabled=guidance.enabled)
        with self.timed("prepare"):
            rows = 2 if guidance.enabled and not apart else 1  # batched guidance: [negative; positive]
            texts = ([self.shard(negative), self.shard(positive)] if apart else
                     [self.shard(positive if negative is None else jnp.concatenate([negative, positive]))])
            image = None if image_embeds is None else self.shard(jnp.concatenate([image_embeds] * rows))
            shared = {k: (self.shard(jnp.concatenate([v] * rows)) if k in BATCHED and rows > 1 else v)
                      for k, v in extra.items()}
            if high is not None:
                shared["high_noise"] = jax.device_put(high)
            conds = [dict(shared) for _ in texts]
            if not self.offload_experts:  # the experts' keys and values of the prompts, once for the whole loop
                for cond, text in zip(conds, texts):
                    cond["kv"] = self._kv(self.transformer, text, image)
                    if high is not None:
                        cond["kv_2"] = self._kv(self.transformer_2, text, image)
            x = jax.block_until_ready(self.shard(start))
        x = self.denoise(schedule, x, tuple(conds) if apart else conds[0], draws.loop_key, guidance=guidance,
                         text=(texts, image), progress=progress)
        if "first_frame" in extra:  # TI2V: the first latent frame is the image's
            m = extra["frame_mask"]
            x = (1 - m) * extra["first_frame"] + m * x
        return self.finish(x, output_type, guided_by=f"guidance_scale (now {guidance_scale:g})"
                           if guidance.enabled else None)

    def _kv(self, transformer, text, image):
        return cross_attention_kv(transformer, text, image, dtype=self.activations_dtype)

    def denoise(self, schedule, x, cond, key, *, guidance: Guidance, text, progress: bool):
        """The loop with both experts resident (or the one transformer), or, with :attr:`offload_experts`, in two
        segments, each with only its expert on the devices (its keys and values of ``text``: ``(texts, image)``, the
        prompts' embeddings, one array or, with the halves apart, ``cond``'s two, and the image tokens, computed when
        it arrives). ``cond``: one dict, or two (negative, positive) where guidance runs its halves apart."""
        halves = cond if isinstance(cond, tuple) else (cond,)
        two = "high_noise" in halves[0]
        if not self.offload_experts:
            denoiser = WanDenoiser(self.transformer, self.transformer_2 if two else None, self.activations_dtype)
            return self.run_loop(denoiser, self.scheduler, schedule.state, x, cond, key, guidance=guidance,
                                 num_steps=schedule.num_steps, progress=progress)
        begin = int(schedule.state.begin_index)  # past 0 where strength cut the schedule (video-to-video)
        flags = np.asarray(halves[0]["high_noise"])[begin:begin + schedule.num_steps] if two else None
        high = int(np.sum(flags)) if two else schedule.num_steps
        state = schedule.state
        halves = [{k: v for k, v in c.items() if k != "high_noise"} for c in halves]
        texts, image = text
        with self.timed("denoise"), progress_bar(schedule.num_steps, "denoising", enabled=progress):
            for name, steps in (("transformer", high), ("transformer_2", schedule.num_steps - high)):
                if steps == 0:
                    continue
                expert = self.on_devices(getattr(self, name))
                halves = [{**c, "kv": self._kv(expert, t, image)} for c, t in zip(halves, texts)]
                x, state, key = denoise_loop(WanDenoiser(expert, None, self.activations_dtype), self.scheduler, state,
                                             x, tuple(halves) if len(halves) > 1 else halves[0], key,
                                             guidance=guidance, num_steps=steps, progress=progress, return_state=True)
                x = jax.block_until_ready(x)
                del expert  # its device buffers go before the next expert's arrive
                halves = [{k: v for k, v in c.items() if k != "kv"} for c in halves]
        return x

    @checked_call
    def __call__(self, prompt: str | Sequence[str] | None = None, *,
                 negative_prompt: str | Sequence[str] | None = None, height: int | None = None,
                 width: int | None = None, num_frames: int = DEFAULT_FRAMES, num_inference_steps: int = 50,
                 guidance_scale: float = 5.0, guidance_scale_2: float | None = None,
                 boundary_ratio: float | None = None, num_videos_per_prompt: int = 1, seed: int | None = None,
                 key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None, negative_prompt_embeds=None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, output_type: str = "uint8", progress: bool = True):
        """Videos for ``prompt`` with diffusers' ``WanPipeline`` arguments: uint8 ``[n, num_frames, height, width,
        3]``, or the final latents ``[n, T, h, w, C]`` (channels-last) with ``output_type="latent"``.

        Args:
            prompt: What to generate.
            negative_prompt: What to steer away from (classifier-free guidance; default "").
            height: Height in pixels, a multiple of 16 (32 for TI2V-5B); default 480.
            width: Width in pixels, a multiple of 16 (32 for TI2V-5B); default 832.
            num_frames: Frames per video, 4k+1 (81 is Wan's default: 5 seconds at 16 fps).
            num_inference_steps: Number of denoising steps.
            guidance_scale: Classifier-free guidance scale (of the high-noise expert with two); 1 or less turns
                guidance off.
            guidance_scale_2: Wan 2.2 A14B: the low-noise expert's guidance scale (default: guidance_scale).
            boundary_ratio: Wan 2.2 A14B: the fraction of the training timesteps above which the high-noise expert
                runs (default: the folder's; 0.875 for text-to-video).
            num_videos_per_prompt: Videos per prompt.
            seed: Random seed (the same seed gives the same videos).
            latents: The initial noise ``[n, T, h, w, C]``, channels-last (an array).
            prompt_embeds: UMT5 embeddings ``[n, seq, text_dim]`` instead of ``prompt``.
            negative_prompt_embeds: UMT5 embeddings of the negative prompt.
            max_sequence_length: UMT5's prompt length in tokens (padded to it).
            output_type: ``"uint8"`` frames, ``"np"`` (float32 in [0, 1]), ``"pil"`` (per video a list of PIL
                frames) or ``"latent"`` (channels-last latents).
            progress: Show a progress bar.
        """
        key = resolve_key(seed, key)
        positive, negative = self.prompts(
            num_videos_per_prompt, prompt, negative_prompt, guided=guidance_scale > 1, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, max_sequence_length=max_sequence_length)
        height, width = height or DEFAULT_SIZE[0], width or DEFAULT_SIZE[1]
        shape = self.video_latents_shape(positive.shape[0], num_frames, height, width, self.latent_channels)
        return self.generate(positive, negative, shape=shape, num_inference_steps=num_inference_steps,
                             guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2,
                             boundary_ratio=boundary_ratio, key=key, latents=latents, output_type=output_type,
                             progress=progress)


# The conditioning arrays with one row per video (doubled for batched guidance); the others are shared.
BATCHED = ("condition", "first_frame")


# -- single files: the Wan-AI repositories' original names, as layouts ---------------------------------------------

_SINGLE_FILE = dict(family="Wan", pipelines=("WanPipeline", "WanImageToVideoPipeline"),
                    tokenizers={"tokenizer": "text_encoder"}, hub_id="Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
# The layouts eqxdiff.load_pipeline(file, config=WAN_FOLDER) reads (listed in eqxdiff.core.SINGLE_FILE_LAYOUTS): a
# transformer in the original names, bare (the Wan-AI repositories; Kijai's repackagings) or below ComfyUI's
# model.diffusion_model., or an original VAE; each config read from the tensors unless config= holds its
# config.json. The rest of the pipeline comes from config= (its model_index.json says T2V or I2V). The released
# models are told apart by their tensors (width and input channels, CLIP image embedder, first-last-frame positions;
# 2.2's VAE by its 48 latent channels) only for the Hub folder messages suggest as config=; any other size reads too.
_RELEASES = (("flf2v_14b", 5120, 36, ("img_emb.emb_pos",), "Wan-AI/Wan2.1-FLF2V-14B-720P-Diffusers"),
             ("i2v_14b", 5120, 36, ("img_emb.proj.",), "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"),
             ("i2v_a14b", 5120, 36, (), "Wan-AI/Wan2.2-I2V-A14B-Diffusers"),
             ("t2v_14b", 5120, 16, (), "Wan-AI/Wan2.1-T2V-14B-Diffusers"),
             ("ti2v_5b", 3072, 48, (), "Wan-AI/Wan2.2-TI2V-5B-Diffusers"), ("", None, None, (), _SINGLE_FILE["hub_id"]))


def _transformer_layouts(name: str, prefix: str) -> tuple[Layout, ...]:
    patch = prefix + "patch_embedding.weight"
    return tuple(Layout(name=f"{name}_{release}".rstrip("_"), parts=(formats.WanTransformer(prefix=prefix),),
                        signature=(patch, prefix + "head.modulation", *(prefix + n for n in names),
                                   *((Sized(patch, 0, width), Sized(patch, 1, channels)) if width else ())),
                        **{**_SINGLE_FILE, "hub_id": hub_id}) for release, width, channels, names, hub_id in _RELEASES)


_VAE = ("encoder.conv1.weight", "decoder.middle.0.residual.0.gamma")
SINGLE_FILE_LAYOUTS = (
    *_transformer_layouts("wan", ""), *_transformer_layouts("wan_comfyui", formats.WAN_DIFFUSION_MODEL),
    Layout(name="wan_vae_2.2", signature=(*_VAE, Sized("conv2.weight", 0, 48)), parts=(formats.WanVae(prefix=""),),
           **{**_SINGLE_FILE, "hub_id": "Wan-AI/Wan2.2-TI2V-5B-Diffusers"}),
    Layout(name="wan_vae", signature=_VAE, parts=(formats.WanVae(prefix=""),), **_SINGLE_FILE),
)
