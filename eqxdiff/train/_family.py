"""What a model family gives the shared train stack: a :class:`TrainModel` bundle.

A bundle is an ``eqx.Module`` holding the model that trains (``DENOISER``: a UNet, a transformer), its text
encoders, its VAE and the token ids of the empty prompt, and saying

- which batch keys carry each text encoder's token ids (``TEXT``), what the encoders produce (``CONDITION_KEYS``,
  cached by :func:`eqxdiff.train.cache_arrays` when they are frozen) and which per-image facts the data must
  record beside the pixels (``IMAGE_KEYS``, names from :data:`eqxdiff.data.IMAGE_FACTS`: SDXL asks for each
  image's original size and crop);
- its own training options (``OPTIONS``: a frozen dataclass subclassing :class:`FamilyOptions`, held in the
  bundle's static ``options``; ``TrainConfig.family`` and ``--family.*`` set them): Flux's guidance and T5 length.
  ``TextInput.length`` names the option that sets an encoder's token count, ``CALL_OPTIONS`` the options the
  pipeline's call takes as trained (for samples);
- :meth:`~TrainModel.encode_text`: token ids to the conditioning arrays;
- :meth:`~TrainModel.denoise`: the model call the objective drives (``denoise(x_t, t, cond)`` in the latents'
  channels-last layout; the objective, DDPM noise prediction or flow matching, comes from the noise scheduler,
  ``NOISE_SCHEDULER`` on the folder's config); :meth:`~TrainModel.training_inputs` (default: the identity) may
  turn the noisy latents and timesteps into what ``denoise`` takes and mask the loss (Wan 2.2 TI2V's clean first
  frame).
- :meth:`~TrainModel.sample_calls`: the pipeline calls that draw a run's samples (default: its ``PIPELINE`` on the
  sample prompts alone); a family whose training conditions on data beside the text (Wan 2.2 TI2V's first frame)
  samples that task too, from the dataset's first example.

:meth:`~TrainModel.from_pipeline` (the bundle, its tokenizers and noise scheduler from a loaded pipeline) is shared
too: it reads the components the declarations name. Everything else (the loss, caption dropout, latents from pixels
or from the cache, the loop, the optimizer, the mesh, remat, checkpoints, export) is shared. A family adds its
bundle file and one line in ``eqxdiff/train/_families.py``.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Float, PRNGKeyArray
from ..core import resolve_class
from ..loading import token_ids
from ..loading.lora import Naming
from ..pipelines import DiffusionPipeline

CACHED_LATENTS = ("latent_mean", "latent_std")  # the VAE posterior, cached in place of pixel_values


@dataclasses.dataclass(frozen=True)
class FamilyOptions:
    """A model family's own training options: the base, with none. A family with options subclasses it (a frozen
    dataclass whose fields carry docstrings: they become ``eqxdiff-train``'s ``--family.*`` flags under the family's
    presets) and names the subclass in its bundle's ``OPTIONS``. ``TrainConfig(family=FamilyOptions())``: the
    defaults of the family the model turns out to be."""


class TextInput(NamedTuple):
    """One text encoder of a bundle: the batch key of its token ids, its tokenizer's and its own component names
    in the pipeline folder, and ``length``: the family option (a field of its ``OPTIONS``) that sets how many token
    ids a caption takes (``None``: the tokenizer's ``model_max_length``, as the pipelines pad)."""

    key: str
    tokenizer: str
    encoder: str
    length: str | None = None


class SampleCall(NamedTuple):
    """One set of a run's samples (:meth:`TrainModel.sample_calls`): the pipeline class drawing them (its
    ``model_index.json`` ``_class_name``, built on the bundle's components) and the call's inputs beside the prompts
    and the shared sampling arguments (an ``image``: ``{"image": uint8 or [0, 1] floats [H, W, 3]}``)."""

    pipeline: str
    inputs: Mapping[str, Any] = {}


class NullCondition(eqx.Module):
    """The encoded empty prompt (batch 1), kept once the text encoders leave the bundle (cached runs): the token
    embeddings and, for families with one, the pooled embedding. Replicated on a mesh."""

    embeds: Float[Array, "1 seq embed"]
    pooled: Float[Array, "1 pooled"] | None = None

    PARAM_AXES: ClassVar = {"embeds": (None, None, None), "pooled": (None, None)}


class TrainModel(eqx.Module):
    """Base of the families' training bundles (see the module docstring). Subclasses declare the class variables
    and fields named as the pipeline's components (``DENOISER``, each ``TEXT`` encoder, ``vae``), ``null_<key>``
    (token ids of the empty prompt) for each ``TEXT`` key and ``null_embeds``, and implement :meth:`encode_text` and
    :meth:`denoise`."""

    DENOISER: ClassVar[str]
    TEXT: ClassVar[tuple[TextInput, ...]]
    CONDITION_KEYS: ClassVar[tuple[str, ...]]  # (token embeddings, [pooled]) as the denoiser reads them
    IMAGE_KEYS: ClassVar[tuple[str, ...]] = ()  # per-image facts of eqxdiff.data.IMAGE_FACTS the denoiser reads
    CLEAN_CAPTION: ClassVar = None  # staticmethod(f): captions cleaned as the family's pipeline cleans prompts
    PIPELINE: ClassVar[str]  # the pipeline class (model_index.json ``_class_name``) exported
    NOISE_SCHEDULER: ClassVar[type]  # the training noise process, built on the pipeline folder's scheduler config
    TRAINABLE_TEXT_ENCODERS: ClassVar[tuple[str, ...] | None] = None  # train_text_encoder's; None: all of TEXT
    OPTIONS: ClassVar[type[FamilyOptions]] = FamilyOptions
    CALL_OPTIONS: ClassVar[tuple[str, ...]] = ()  # options the pipeline's __call__ takes as trained (samples)
    LORA_KOHYA: ClassVar[tuple[Naming, ...]] = ()  # how kohya's LoRA files name each model (--lora.format kohya)
    VIDEO: ClassVar[bool] = False  # trains on video clips (pixel_values [batch, frames, H, W, 3]), not on images

    options: FamilyOptions = eqx.field(static=True, default=None, kw_only=True)  # None: OPTIONS()

    def __post_init__(self):
        if self.options is None:
            self.options = self.OPTIONS()
        if type(self.options) is not self.OPTIONS:
            raise TypeError(f"{type(self).__name__} takes {self.OPTIONS.__name__} options, got {self.options!r}")

    def param_axes(self) -> dict:
        return {f"null_{t.key}": (None,) for t in self.TEXT}  # token ids: replicated

    # -- what a family implements --------------------------------------------------------------------------------

    def encode_text(self, ids: Mapping[str, Array]) -> dict[str, Array]:
        """The conditioning arrays (``CONDITION_KEYS``) of token ids (``{TEXT key: [batch, seq]}``)."""
        raise NotImplementedError

    def denoise(self, x: Float[Array, "batch height width channels"], t, cond: Mapping[str, Array]) -> Array:
        """The trained model's prediction at ``x`` (noisy latents), timesteps ``t`` ``[batch]`` (the noise
        scheduler's: DDPM indices, or flow-matching timesteps in [0, 1000]), conditioning ``cond``."""
        raise NotImplementedError

    def training_inputs(self, x0: Array, noisy: Array, t: Array, *, key: PRNGKeyArray):
        """``(model input, timesteps, loss mask)`` of a training step's clean latents ``x0``, noisy latents and
        timesteps ``t`` ``[batch]``: what :meth:`denoise` is called with (the timesteps may become one per token) and
        which elements of its output the loss counts (broadcastable to it; ``None``: all). ``key``: its own draws
        (from the step's key, so a resumed run draws the same). The default is the identity, every element counted;
        a family whose pipeline conditions on part of the clean latents (Wan 2.2 TI2V's first frame) overrides it."""
        return noisy, t, None

    # -- shared ----------------------------------------------------------------------------------------------------

    @classmethod
    def from_pipeline(cls, pipe: DiffusionPipeline, options: FamilyOptions | None = None):
        """``(bundle, tokenizers {component name: tokenizer}, noise scheduler)`` of a loaded pipeline: its
        components the bundle's fields name, the empty prompt's token ids at :meth:`text_lengths`, ``options``
        (default ``OPTIONS()``) and ``NOISE_SCHEDULER`` on the folder's scheduler config. A family that must check
        the pipeline first (SDXL: not a refiner) overrides this and calls it."""
        options = cls.OPTIONS() if options is None else options
        tokenizers = {t.tokenizer: getattr(pipe, t.tokenizer) for t in cls.TEXT}
        lengths = cls.text_lengths(tokenizers, options)
        nulls = {f"null_{t.key}": jnp.asarray(token_ids(tokenizers[t.tokenizer], [""], lengths[t.key])[0])
                 for t in cls.TEXT}
        models = {name: getattr(pipe, name) for name in (cls.DENOISER, *(t.encoder for t in cls.TEXT), "vae")}
        bundle = cls(**models, **nulls, options=options)
        return bundle, tokenizers, cls.NOISE_SCHEDULER.from_config(pipe.scheduler.config.to_dict())

    @classmethod
    def text_lengths(cls, tokenizers: Mapping[str, Any], options: FamilyOptions | None = None) -> dict[str, int]:
        """``{TEXT key: token ids per caption}``: the option a ``TextInput.length`` names (Flux's T5:
        ``max_sequence_length``), else the tokenizer's ``model_max_length`` (as the pipelines pad)."""
        options = cls.OPTIONS() if options is None else options
        return {t.key: getattr(options, t.length) if t.length else tokenizers[t.tokenizer].model_max_length
                for t in cls.TEXT}

    def call_options(self) -> dict[str, Any]:
        """The pipeline call's arguments that must be as trained (``CALL_OPTIONS`` from :attr:`options`: Flux's
        ``max_sequence_length``), for samples."""
        return {name: getattr(self.options, name) for name in self.CALL_OPTIONS}

    @classmethod
    def check_folder(cls, options: FamilyOptions, model_index: Mapping[str, Any]) -> None:
        """``ValueError`` where ``options`` (the run's ``--family.*``) ask for what a pipeline folder cannot train,
        read from its ``model_index.json`` (``model_index``: its components and pipeline settings) before anything is
        loaded; :meth:`from_pipeline`'s bundle checks the same on the loaded pipeline. Default: nothing to check."""

    def sample_calls(self, example: Callable[[], Mapping[str, Any]]) -> tuple[SampleCall, ...]:
        """The pipeline calls that draw a run's samples, each on every sample prompt, their outputs logged in this
        order along the batch axis. ``example()`` reads the dataset's first training example (a batch of 1, as the
        data gives it: ``pixel_values`` ``[1, (F,) H, W, 3]`` in [-1, 1] and the token ids) for a family whose samples
        take an input from the data; it is read only when called. Default: the family's ``PIPELINE`` on the prompts
        alone (text-to-image, text-to-video); Wan 2.2 TI2V adds image-to-video from the example's first frame."""
        return (SampleCall(self.PIPELINE),)

    @classmethod
    def sample_size(cls, config) -> dict[str, Any]:
        """The size arguments of samples' pipeline calls for a run of ``config`` (a ``TrainConfig``); default none:
        the pipeline's default size."""
        return {}

    @property
    def denoiser(self):
        return getattr(self, self.DENOISER)

    @classmethod
    def batch_keys(cls, cached: bool) -> tuple[str, ...]:
        """The keys a batch holds: pixels and token ids, or (``cached``) the VAE posterior and the encoders'
        outputs; with the per-image conditioning either way."""
        if cached:
            return (*CACHED_LATENTS, *cls.CONDITION_KEYS, *cls.IMAGE_KEYS)
        return ("pixel_values", *(t.key for t in cls.TEXT), *cls.IMAGE_KEYS)

    def null_ids(self) -> dict[str, Array]:
        return {t.key: getattr(self, f"null_{t.key}") for t in self.TEXT}

    def null_condition(self) -> dict[str, Array]:
        """The empty prompt's conditioning (batch 1): kept in ``null_embeds`` once the encoders are gone, else
        encoded now."""
        null = getattr(self, "null_embeds", None)
        if null is None:
            return self.encode_text({k: v[None] for k, v in self.null_ids().items()})
        return dict(zip(self.CONDITION_KEYS, (null.embeds, null.pooled)[:len(self.CONDITION_KEYS)]))

    @classmethod
    def trainable_text_encoders(cls) -> tuple[str, ...]:
        """The text encoders ``train_text_encoder`` (or LoRA's ``text_encoders``) trains: ``TRAINABLE_TEXT_ENCODERS``,
        by default every one of ``TEXT``."""
        return tuple(cls.TRAINABLE_TEXT_ENCODERS or [t.encoder for t in cls.TEXT])

    def trained_denoisers(self) -> tuple[str, ...]:
        """The denoisers a run trains (in full, or through LoRA adapters): ``DENOISER``; a family with several
        (Wan 2.2 A14B's experts) says which of them its options train."""
        return (self.DENOISER,)

    def trainable(self, *, train_text_encoder: bool = False, train_vae: bool = False):
        """A filter spec (the bundle's structure, bools at the leaves): the trained denoisers' arrays
        (:meth:`trained_denoisers`), plus the text encoders' (:meth:`trainable_text_encoders`) and the VAE's if
        asked."""
        spec = jax.tree.map(lambda _: False, self)
        names = list(self.trained_denoisers())
        if train_text_encoder:
            names += [n for n in self.trainable_text_encoders() if getattr(self, n) is not None]
        if train_vae:
            names.append("vae")
        for name in names:
            spec = eqx.tree_at(lambda m, n=name: getattr(m, n), spec,
                               jax.tree.map(eqx.is_inexact_array, getattr(self, name)))
        return spec

    def latents(self, batch: Mapping[str, Array], key: PRNGKeyArray) -> Array:
        """Scaled latents ``[batch, h, w, c]``: a sample of the VAE posterior (cached or encoded now), through the
        VAE's ``scale_latents`` with the statistics the family's pipeline reads (its ``LATENT_NORM``), so that
        training and sampling share one latent space."""
        if CACHED_LATENTS[0] in batch:
            mean, std = batch["latent_mean"], batch["latent_std"]
            z = mean + std * jax.random.normal(key, mean.shape, mean.dtype)
        else:
            z = self.vae.encode(batch["pixel_values"]).sample(key=key)
        return self.pipeline_class().scale_latents(self.vae, z)

    def condition(self, batch: Mapping[str, Array], key: PRNGKeyArray, caption_dropout: float) -> dict[str, Array]:
        """The denoiser's conditioning for ``batch``: cached or encoded text (the empty prompt's for a
        ``caption_dropout`` fraction of the samples) and the per-image keys."""
        images = {k: batch[k] for k in self.IMAGE_KEYS}
        b = batch[self.batch_keys(CACHED_LATENTS[0] in batch)[0]].shape[0]
        if self.CONDITION_KEYS[0] in batch:
            text = {k: batch[k] for k in self.CONDITION_KEYS}
            if caption_dropout > 0:
                drop, null = jax.random.bernoulli(key, caption_dropout, (b,)), self.null_condition()
                text = {k: jnp.where(drop.reshape((b,) + (1,) * (v.ndim - 1)), null[k].astype(v.dtype), v)
                        for k, v in text.items()}
            return {**text, **images}
        ids = {t.key: batch[t.key] for t in self.TEXT}
        if caption_dropout > 0:
            drop, null = jax.random.bernoulli(key, caption_dropout, (b, 1)), self.null_ids()
            ids = {k: jnp.where(drop, null[k][None], v) for k, v in ids.items()}
        return {**self.encode_text(ids), **images}

    # -- the encoders leave and come back ------------------------------------------------------------------------

    def text_encoders(self) -> dict[str, Any]:
        return {t.encoder: getattr(self, t.encoder) for t in self.TEXT}

    def without_text_encoders(self):
        """``(bundle, encoders)``: the bundle without its text encoders (``None``), holding the encoded empty prompt
        instead (:class:`NullCondition`), and the encoders taken out (for :meth:`with_text_encoders`). For runs
        whose text embeddings are cached: the encoders need no device memory during training."""
        null = jax.device_get(encode_null(self))
        held = NullCondition(*(jnp.asarray(null[k]) for k in self.CONDITION_KEYS))
        encoders = self.text_encoders()
        names = list(encoders)
        bundle = eqx.tree_at(lambda m: [getattr(m, n) for n in names], self, [None] * len(names),
                             is_leaf=lambda x: x is None)
        bundle = eqx.tree_at(lambda m: m.null_embeds, bundle, held, is_leaf=lambda x: x is None)
        return bundle, encoders

    def with_text_encoders(self, encoders: Mapping[str, Any]):
        """The bundle with ``encoders`` (from :meth:`without_text_encoders`) back in place."""
        names = [n for n in encoders if getattr(self, n) is None]
        if not names:
            return self
        return eqx.tree_at(lambda m: [getattr(m, n) for n in names], self, [encoders[n] for n in names],
                           is_leaf=lambda x: x is None)

    # -- as a pipeline -----------------------------------------------------------------------------------------

    @classmethod
    def pipeline_class(cls, name: str | None = None) -> type[DiffusionPipeline]:
        """The pipeline class named ``name`` (default ``PIPELINE``, the one exported)."""
        name = cls.PIPELINE if name is None else name
        found = resolve_class(name)
        if found is None:
            raise TypeError(f"{cls.__name__} uses a {name}, which eqxdiff does not serve yet")
        return found

    def pipeline(self, tokenizers: Mapping[str, Any], scheduler, *, options: Mapping[str, Any] | None = None,
                 class_name: str | None = None, **kwargs) -> DiffusionPipeline:
        """The family's pipeline of this bundle's models, ``tokenizers`` (by component name) and ``scheduler``
        (to sample from, or to save with :func:`eqxdiff.pipelines.save_pipeline`): ``PIPELINE``, or the pipeline
        class ``class_name`` on the same components (a sample call's: :meth:`sample_calls`; components the bundle
        does not hold are ``None``); ``kwargs`` go to the pipeline (``offload_encoders``, ``mesh`` ...)."""
        cls = self.pipeline_class(class_name)
        components = {}
        for c in cls.COMPONENTS:
            if c.kind == "tokenizer":
                components[c.name] = tokenizers.get(c.name)
            elif c.kind == "scheduler":
                components[c.name] = scheduler
            else:
                components[c.name] = getattr(self, c.name, None)
        return cls(**components, **dict(options or {}), **kwargs)


@eqx.filter_jit
def encode_null(bundle: TrainModel) -> dict[str, Array]:
    return bundle.encode_text({k: v[None] for k, v in bundle.null_ids().items()})


@eqx.filter_jit
def encode_batch(bundle: TrainModel, batch: Mapping[str, Array]) -> dict[str, Array]:
    """What the cache holds for a batch of pixels and token ids: the VAE posterior's ``latent_mean`` /
    ``latent_std`` (training still draws a fresh latent each step), the text encoders' outputs and the per-image
    keys as they are."""
    dist = bundle.vae.encode(batch["pixel_values"])
    text = bundle.encode_text({t.key: batch[t.key] for t in bundle.TEXT})
    return {"latent_mean": dist.mean, "latent_std": dist.std, **text, **{k: batch[k] for k in bundle.IMAGE_KEYS}}
