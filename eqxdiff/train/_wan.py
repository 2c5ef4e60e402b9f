"""Wan 2.1 / 2.2 text-to-video (diffusers' ``WanPipeline`` folders), rectified-flow matching on video latents.

The latents are the Wan VAE's posterior sample normalised as the pipeline does (``(z - latents_mean) /
latents_std`` per channel: the VAE's ``scale_latents``), ``[b, T, h, w, C]`` channels-last; ``x_t = (1 - sigma) x0 +
sigma * noise`` with the target ``noise - x0`` at the flow-matching training schedule of the folder's
``flow_shift`` (Wan's scheduler_config.json: 3.0 for 2.1 and 2.2 A14B, 5.0 for TI2V-5B) and the transformer called at
``t = 1000 sigma`` (as the pipeline's scheduler timesteps). Text is UMT5's last hidden state with the attention mask
and every position past the caption zero (diffusers' trim and zero padding), at ``max_sequence_length`` tokens (512
as the pipeline). Captions are cleaned as the pipeline cleans prompts (``clean_prompt``: ``ftfy`` if installed, HTML
entities unescaped, whitespace runs made one space), so a caption trains as the same prompt reads at inference.

**Two experts (Wan 2.2 A14B).** A folder with ``transformer_2`` and ``boundary_ratio`` runs ``transformer`` (high
noise) at the timesteps ``t >= boundary_ratio * 1000`` and ``transformer_2`` below; each expert trains on its own
range (:class:`WanOptions`' ``expert``):

- ``both`` (default): both train in one run. Timesteps are drawn over the whole schedule and each sample goes to the
  expert of its timestep: each expert runs on the batch only when one of its samples is there (``lax.cond``; one
  program holds each expert once), and each sample keeps its expert's output. Both experts' weights and optimizer
  states are trained (FSDP shards them).
- ``high`` / ``low``: one expert trains, its timesteps drawn from its own range only (the training schedule
  restricted to it: :class:`ExpertTimesteps`); the other rides along frozen (it is in the export). Two such runs
  (the second from the first's export) train both with half the optimizer state each.

A folder with one transformer (2.1, TI2V-5B) trains it on every timestep (``expert='both'``).

**First-frame conditioning (Wan 2.2 TI2V-5B).** A folder whose pipeline has ``expand_timesteps`` (per-token
timesteps) is one model for text- and image-to-video; its image-to-video pipeline keeps the first latent frame at the
image's latents with the timestep 0 on its tokens. A ``family.first_frame_probability`` fraction of the samples
(drawn per sample from the step's key) train so (:meth:`WanFlowMatching.training_inputs`): their first latent frame
is the clean latents (the VAE's first latent frame depends on the first pixel frame alone, so it is the image's
latents, a posterior sample where the pipeline takes the mode), its tokens get the timestep 0, the others the
sample's, and the loss leaves that frame out (the mean over the other frames); the other samples train as
text-to-video (every token at the sample's timestep, the same as one per sample). Folders without
``expand_timesteps`` train text-to-video only.

**Samples** drawn during a run (``sample_prompts``) show the tasks it trains (:meth:`WanFlowMatching.sample_calls`),
as a validation set with images does in finetrainers' I2V training (diffusers' own scripts train no Wan): text-to-video
(``WanPipeline``) when some samples train without the first frame, image-to-video (``WanImageToVideoPipeline``, which
serves TI2V-5B folders) when some train with it, so the default 0.5 draws both (text-to-video first, then
image-to-video, each on every prompt) and 1.0 image-to-video only. Every image-to-video sample starts from one frame:
the first frame of the dataset's first clip (its first record, unshuffled, through the run's size and frame
sampling), so samples at successive steps compare. An example without pixels (cached latents only) gives
text-to-video samples only, with a log line saying why.
"""

import dataclasses
import math
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Int
from ..loading import token_ids
from ..pipelines.wan import clean_prompt, model_input, token_mask, umt5_embeddings
from ..schedulers import FlowMatchEulerDiscreteScheduler
from ._checks import check_choice
from ._family import FamilyOptions, NullCondition, SampleCall, TextInput, TrainModel
from ._metrics import log_line

EXPERTS = ("both", "high", "low")


@dataclasses.dataclass(frozen=True)
class WanOptions(FamilyOptions):
    """Wan's training options (``--family.*`` under the ``wan2.*`` presets)."""

    expert: str = "both"
    """Wan 2.2 A14B's experts: ``both`` train, each on the samples of its timestep range; ``high`` trains
    ``transformer`` on ``t >= boundary_ratio * 1000`` only, ``low`` ``transformer_2`` below it (the other frozen). A
    folder with one transformer takes ``both`` (all timesteps)."""
    max_sequence_length: int = 512
    """UMT5's caption length in tokens, in training and in the samples (the pipeline's ``max_sequence_length``)."""
    first_frame_probability: float | None = None
    """Wan 2.2 TI2V-5B (a folder with ``expand_timesteps``): the fraction of samples trained image-to-video, their
    first latent frame clean at timestep 0 and left out of the loss (the rest train text-to-video). None: 0.5 for such
    a folder (TI2V-5B is one model for both tasks: half of each keeps both, as its own T2V + I2V training does), 0
    for any other; 0: text-to-video only. A folder without ``expand_timesteps`` takes only 0 (or None). The run's
    samples show the tasks it trains: text-to-video below 1, image-to-video (from the first frame of the dataset's
    first clip) above 0; both in between."""

    def __post_init__(self):
        check_choice("expert", self.expert, EXPERTS)
        if not 1 <= self.max_sequence_length <= 512:
            raise ValueError(f"max_sequence_length={self.max_sequence_length} must be in [1, 512] (the Wan "
                             "pipelines' prompt length)")
        p = self.first_frame_probability
        if p is not None and not 0.0 <= p <= 1.0:
            raise ValueError(f"first_frame_probability={p} must be in [0, 1] (or None: 0.5 for a TI2V folder)")


class ExpertTimesteps(FlowMatchEulerDiscreteScheduler):
    """The flow-matching scheduler whose training schedule keeps only the timesteps in ``[low, high)`` (one expert's
    range), in order, so a density draw ``u`` in [0, 1] maps over that range as it maps over the whole one (a uniform
    ``u`` gives each of the range's timesteps the same share, as the whole schedule's does);
    ``timestep_range=None``: the whole schedule. Sampling is unchanged (``init`` reads the whole schedule)."""

    timestep_range: tuple[float, float] | None = eqx.field(static=True, default=None)

    def training_schedule(self) -> tuple[np.ndarray, np.ndarray]:
        timesteps, sigmas = super().training_schedule()
        if self.timestep_range is None:
            return timesteps, sigmas
        low, high = self.timestep_range
        keep = np.flatnonzero((timesteps >= np.float32(low)) & (timesteps < np.float32(high)))
        if len(keep) == 0:
            raise ValueError(f"no training timestep lies in [{low}, {high}): the expert's range is empty (check the "
                             "folder's boundary_ratio)")
        return timesteps[keep], sigmas[keep]


def prompt_mask(ids: Int[Array, "batch seq"], eos_token_id: int) -> Int[Array, "batch seq"]:
    """The tokenizer's attention mask of right-padded ids: 1 up to and including each caption's first end token
    (every position where no end token is: a caption cut to the length keeps its end token, so that is none)."""
    is_eos = ids == eos_token_id
    n = ids.shape[1]
    last = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), n - 1)
    return (jnp.arange(n)[None, :] <= last[:, None]).astype(jnp.int32)


def _check_boundary(two_experts: bool, ratio) -> None:
    """``ValueError`` for a folder whose experts and ``boundary_ratio`` disagree: two experts need a ratio in (0, 1)
    (at 0 or 1, or outside, one expert's timestep range is empty and it would train on nothing), one takes none."""
    if two_experts != (ratio is not None):
        raise ValueError("a Wan folder with transformer_2 needs boundary_ratio (and one with boundary_ratio needs "
                         f"transformer_2): got transformer_2 {'present' if two_experts else 'absent'}, "
                         f"boundary_ratio={ratio}; fix the folder's model_index.json")
    if two_experts and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1):
        raise ValueError(f"the folder's boundary_ratio={ratio!r} must be in (0, 1): the experts split the timesteps "
                         "there, and outside it one of them trains on none (Wan 2.2 A14B's is 0.875); fix the folder's "
                         "model_index.json")


def _check_options(options: WanOptions, *, two_experts: bool, expand: bool) -> None:
    """``ValueError`` for options a folder cannot train: one expert picked of a single transformer, or first-frame
    conditioning without per-token timesteps."""
    if options.expert != "both" and not two_experts:
        raise ValueError(f"family.expert={options.expert!r} picks one of Wan 2.2 A14B's two experts, but this folder "
                         "has one transformer: set family.expert='both'")
    if options.first_frame_probability and not expand:
        raise ValueError(f"family.first_frame_probability={options.first_frame_probability} trains first-frame "
                         "conditioning, which needs per-token timesteps (a Wan 2.2 TI2V folder with "
                         "expand_timesteps); this folder has none: set family.first_frame_probability=0")


class WanFlowMatching(TrainModel):
    """Wan's ``transformer`` (and A14B's ``transformer_2``), ``text_encoder`` (UMT5), VAE, the empty prompt's token
    ids, the experts' boundary (``boundary_ratio * num_train_timesteps``, ``None`` with one transformer) and the
    tokenizer's end token (the attention mask comes from it), with :class:`WanOptions`."""

    DENOISER: ClassVar[str] = "transformer"
    TEXT: ClassVar = (TextInput("input_ids", "tokenizer", "text_encoder", length="max_sequence_length"),)
    CONDITION_KEYS: ClassVar = ("encoder_hidden_states",)
    PIPELINE: ClassVar[str] = "WanPipeline"
    NOISE_SCHEDULER: ClassVar = ExpertTimesteps
    OPTIONS: ClassVar = WanOptions
    CALL_OPTIONS: ClassVar = ("max_sequence_length",)
    CLEAN_CAPTION: ClassVar = staticmethod(clean_prompt)
    VIDEO: ClassVar = True

    transformer: Any
    transformer_2: Any
    text_encoder: Any
    vae: Any
    null_input_ids: Int[Array, " seq"]
    null_embeds: NullCondition | None = None
    boundary: float | None = eqx.field(static=True, default=None)
    eos_token_id: int = eqx.field(static=True, default=1)
    expand_timesteps: bool = eqx.field(static=True, default=False)

    def __post_init__(self):
        super().__post_init__()
        _check_options(self.options, two_experts=self.transformer_2 is not None, expand=self.expand_timesteps)

    @classmethod
    def check_folder(cls, options, model_index):
        """The folder's second expert (``transformer_2``) with its ``boundary_ratio``, and ``expand_timesteps``, read
        from ``model_index.json``."""
        second = model_index.get("transformer_2")
        two_experts = isinstance(second, (list, tuple)) and second[0] is not None
        _check_boundary(two_experts, model_index.get("boundary_ratio"))
        _check_options(options, two_experts=two_experts, expand=bool(model_index.get("expand_timesteps", False)))

    @property
    def first_frame_probability(self) -> float:
        """The fraction of samples conditioned on their clean first frame (:class:`WanOptions`' default resolved)."""
        p = self.options.first_frame_probability
        return (0.5 if self.expand_timesteps else 0.0) if p is None else p

    def training_inputs(self, x0, noisy, t, *, key):
        """A :attr:`first_frame_probability` fraction of the samples (drawn with ``key``) as TI2V's image-to-video
        pipeline denoises them: the first latent frame the clean ``x0``'s, the timestep 0 on its tokens (``t`` per
        token ``[b, tokens]``, as the pipeline's token mask gives) and that frame left out of the loss; the others as
        they are (see the module docstring)."""
        p = self.first_frame_probability
        if p == 0:
            return noisy, t, None
        b, frames = x0.shape[:2]
        clean = jax.random.bernoulli(key, p, (b,))[:, None] & (jnp.arange(frames) == 0)[None, :]  # [b, T]
        keep = ~clean[:, :, None, None, None]
        frame_mask = jnp.broadcast_to(keep, (*x0.shape[:4], 1)).astype(jnp.float32)  # the pipeline's, per sample
        cond = {"first_frame": x0, "frame_mask": frame_mask,
                "token_mask": token_mask(frame_mask, self.transformer.config.patch_size)}
        x, per_token = model_input(noisy, t[:, None], cond)
        return x, per_token, keep

    def sample_calls(self, example):
        """The tasks the run trains (see the module docstring): ``WanPipeline`` unless every sample trains
        image-to-video, and ``WanImageToVideoPipeline`` when some do, its ``image`` the first frame of ``example()``
        (the clip's first frame as trained, floats in [0, 1]). ``example()`` is read only then; without
        ``pixel_values`` the samples are text-to-video, and a log line says so."""
        p = self.first_frame_probability
        text = SampleCall(self.PIPELINE)
        if p == 0:
            return (text,)
        pixels = example().get("pixel_values")
        if pixels is None:
            log_line(f"note: samples are text-to-video only, though first_frame_probability={p} trains image-to-video: "
                     "the data's first example has no pixels (cached latents) to take a first frame from")
            return (text,)
        first = np.asarray(pixels[0, 0] if np.ndim(pixels) == 5 else pixels[0], np.float32)  # [H, W, 3] in [-1, 1]
        image = np.clip((first + 1.0) / 2.0, 0.0, 1.0)
        video = SampleCall("WanImageToVideoPipeline", {"image": image})
        return (video,) if p == 1 else (text, video)

    @classmethod
    def sample_size(cls, config) -> dict[str, Any]:
        """Samples are videos as the clips trained: the run's size (height, width) and frame count (the pipeline's
        default is 81 frames at 480x832, a long wait inside a training run)."""
        height, width = config.size
        return {"height": height, "width": width, "num_frames": config.frames.count}

    def encode_text(self, ids):
        input_ids = ids["input_ids"]
        return {"encoder_hidden_states": umt5_embeddings(self.text_encoder, input_ids,
                                                         prompt_mask(input_ids, self.eos_token_id))}

    def denoise(self, x, t, cond):
        """The velocity at video latents ``x`` ``[b, T, h, w, C]`` and timesteps ``t`` ``[b]`` (``1000 sigma``; per
        token ``[b, tokens]`` from :meth:`training_inputs`, TI2V's one transformer): the expert of each sample's
        timestep (see the module docstring)."""
        text = cond["encoder_hidden_states"].astype(x.dtype)
        t = t.astype(jnp.float32)

        def high():
            return self.transformer(x, t, text)

        def low():
            return self.transformer_2(x, t, text)

        if self.transformer_2 is None or self.options.expert == "high":
            return high()
        if self.options.expert == "low":
            return low()
        is_high = t >= self.boundary
        zeros = jnp.zeros(x.shape[:-1] + (self.transformer.config.output_channels,), x.dtype)  # an expert not needed
        out_high = jax.lax.cond(jnp.any(is_high), high, lambda: zeros)
        out_low = jax.lax.cond(jnp.all(is_high), lambda: zeros, low)
        return jnp.where(is_high.reshape((-1,) + (1,) * (x.ndim - 1)), out_high, out_low)

    def trained_denoisers(self) -> tuple[str, ...]:
        """The experts ``family.expert`` trains (``both``: each one the folder has)."""
        trains = {"both": ("transformer", "transformer_2"), "high": ("transformer",),
                  "low": ("transformer_2",)}[self.options.expert]
        return tuple(name for name in trains if getattr(self, name) is not None)

    @classmethod
    def from_pipeline(cls, pipe, options=None):
        """The bundle of a loaded ``WanPipeline`` (both experts of an A14B folder), its tokenizer, and the noise
        scheduler: flow matching at the folder's ``flow_shift``, restricted to the expert's range for ``high`` /
        ``low``."""
        options = cls.OPTIONS() if options is None else options
        second, ratio = getattr(pipe, "transformer_2", None), getattr(pipe, "boundary_ratio", None)
        _check_boundary(second is not None, ratio)
        tokenizer = pipe.tokenizer
        length = cls.text_lengths({"tokenizer": tokenizer}, options)["input_ids"]
        raw = pipe.scheduler.config.to_dict()
        n = raw.get("num_train_timesteps", 1000)
        boundary = None if ratio is None else float(np.float32(ratio * n))  # diffusers compares in float32
        bundle = cls(transformer=pipe.transformer, transformer_2=second, text_encoder=pipe.text_encoder, vae=pipe.vae,
                     null_input_ids=jnp.asarray(token_ids(tokenizer, [""], length)[0]), boundary=boundary,
                     eos_token_id=int(tokenizer.eos_token_id),
                     expand_timesteps=bool(getattr(pipe, "expand_timesteps", False)), options=options)
        shift = {} if "shift" in raw else {"shift": float(raw.get("flow_shift", 1.0))}
        scheduler = ExpertTimesteps.from_config(raw, **shift)
        ranges = {"both": None, "high": (boundary, math.inf), "low": (-math.inf, boundary)}
        return bundle, {"tokenizer": tokenizer}, ExpertTimesteps(scheduler.config,
                                                                 timestep_range=ranges[options.expert])
