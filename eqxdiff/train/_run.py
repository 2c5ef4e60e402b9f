"""``run(config)``: everything ``scripts/train.py`` does, callable from a notebook.

Data (checked before anything is built), model (a pretrained pipeline of any family eqxdiff trains: Stable
Diffusion, SDXL, Flux, through its :class:`~eqxdiff.train.TrainModel` bundle; or the from-scratch digits
architecture with its autoencoder stage), optional caching of latents and text embeddings (in memory, or for a
stream to memory-mapped files), the train loop with metrics, checkpoints and samples, and the export of the trained
pipeline in the diffusers format. Nothing here names a family: the bundle says what trains, how text is encoded and
what the denoiser is called with; the noise scheduler says which objective (DDPM or flow matching).
"""

import dataclasses
import inspect
import json
import math
import time
from pathlib import Path

import equinox as eqx
import jax

from ..data import (
    ArrayBatches,
    HFDatasetSource,
    ImageFolderSource,
    SyntheticSource,
    TFRecordSource,
    character_tokenizer,
    make_dataset,
)
from ..data.digits import DigitsSource
from ..loading import check_dtype, load, save_pretrained
from ..parallel import MeshConfig, Plan, Remat, batch_shards, make_mesh, shard_params, with_plan
from ..pipelines import load_pipeline, save_pipeline
from ..schedulers import SCHEDULERS, DDPMScheduler, scheduler_from_config
from ._autoencoder import fit_scaling_factor, train_autoencoder
from ._checkpoint import Checkpointer, CheckpointMismatchError, mismatch_message
from ._data import DataError, cache_arrays, cache_stream, check_batch
from ._digits import SD_NOISE_SCHEDULE, DigitsArchitecture, build_digits_model
from ._families import train_family
from ._family import TrainModel
from ._loop import fit, shard_state
from ._metrics import MetricsLogger
from ._objectives import Objective
from ._step import OptimizerConfig, init_state, make_optimizer, trainable_filter


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. ``model=None`` trains the digits architecture from scratch (``architecture``)."""

    model: str | None = None
    """A diffusers pipeline folder or Hub id to fine-tune; None: build ``architecture`` from scratch."""
    data: str | None = None
    """``digits`` (scikit-learn's handwritten digits), ``synthetic`` (random images, for benchmarks) or an image
    folder with captions (metadata.jsonl / metadata.csv, or a .txt beside each image). None: ``digits`` when
    training from scratch and no other source is given. Give one of ``data``, ``hf_dataset``, ``tfrecord``."""
    hf_dataset: str | None = None
    """A Hugging Face dataset: a Hub id, a folder written by ``save_to_disk``, a .parquet/.json(l)/.csv/.arrow file,
    or a folder ``datasets`` reads (parquet shards, an image folder with metadata.jsonl)."""
    hf_split: str = "train"
    """The split of ``hf_dataset`` to train on."""
    image_column: str | None = None
    """``hf_dataset``'s image column (default ``image``), or the file-name field of an image folder's metadata
    (default ``file_name``)."""
    caption_column: str | None = None
    """``hf_dataset``'s caption column, or the caption field of an image folder's metadata (default ``text``)."""
    tfrecord: tuple[str, ...] = ()
    """TFRecord files of ``tf.train.Example`` records, or folders of ``*.tfrecord*`` files."""
    image_key: str | None = None
    """The ``tfrecord`` feature holding encoded image bytes (default ``image``)."""
    caption_key: str | None = None
    """The ``tfrecord`` feature holding the caption (default ``text``)."""
    resolution: int = 16
    """Training image size (digits are upscaled to it; folders are resized and center-cropped)."""
    batch_size: int = 64
    """Samples per micro-step (over all devices)."""
    steps: int = 1000
    """Micro-steps to train (optimizer updates = steps / optimizer.accumulation_steps)."""
    seed: int = 0
    """Seed of the initialisation, the data order and the training noise."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW, its learning-rate schedule, clipping and gradient accumulation (``--optimizer.*``)."""
    objective: Objective = Objective()
    """What the loss compares and how it weights timesteps (``--objective.*``)."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the trained weights with this decay (exported instead of them)."""
    train_text_encoder: bool = False
    """Train the text encoder too (default: frozen)."""
    cache: bool = True
    """Encode latents and text embeddings once before training (only while the VAE and text encoders are frozen):
    an in-memory dataset (digits) always; a stream (folder, hf_dataset, tfrecord, synthetic) with
    ``cache_stream``. The text encoders then leave the devices (the empty prompt's embeddings are kept)."""
    cache_stream: bool = False
    """With ``cache``: encode a streamed dataset once, one pass in order with its crops and flips drawn once, into
    ``output_dir/cache`` (``.npy`` files read back as memory maps; a resumed run with the same data and model reuses
    them), and train on it in shuffled batches (diffusers' SDXL and Flux recipes). Off: a stream is encoded every
    step, with fresh crops and flips each epoch."""
    center_crop: bool = True
    """Crop each resized image at its center (False: at random; SDXL conditions on where the crop was)."""
    random_flip: bool = True
    """Flip images left-right at random."""
    guidance_scale: float = 3.5
    """A guidance-distilled transformer (FLUX.1-dev's ``guidance_embeds``) trains at this constant guidance
    (diffusers' ``--guidance_scale``); other models ignore it."""
    max_sequence_length: int = 512
    """Flux: T5's caption length in tokens (the pipeline's and diffusers' ``--max_sequence_length``: at most 512);
    CLIP encoders take their tokenizer's length (77)."""
    architecture: DigitsArchitecture = DigitsArchitecture()
    """From scratch (no ``model``): the sizes of the text encoder, UNet and VAE built (``--architecture.*``)."""
    autoencoder_steps: int = 600
    """From scratch: steps of the autoencoder stage that trains the VAE before the UNet."""
    autoencoder_batch_size: int = 32
    """From scratch: images per step of the autoencoder stage."""
    autoencoder_learning_rate: float = 2e-3
    """From scratch: the autoencoder stage's (constant) Adam learning rate."""
    kl_weight: float = 1e-4
    """From scratch: weight of the VAE's KL term (per latent element) against the pixel MSE."""
    mesh: MeshConfig | None = None
    """The device mesh (``data, fsdp, context, tensor`` sizes; -1 fills): the batch is split over data x fsdp, the
    trainable weights, their optimizer state and EMA and the frozen weights are placed by the logical-axis rules
    (replicated under pure data parallelism, sharded over ``fsdp``/``tensor``). ``MeshConfig()``: data parallel
    over every device. None: one device."""
    remat: Remat = Remat.NONE
    """Rematerialisation at block boundaries (UNet blocks, CLIP layers): recompute activations in the backward pass
    instead of keeping them (``eqxdiff.parallel.Remat``)."""
    remat_names: tuple[str, ...] = ()
    """With ``remat`` ``named``/``offload_named``: the checkpoint names to keep (``resnet``, ``transformer``, ...)."""
    output_dir: Path = Path("runs/train")
    """Metrics (metrics.jsonl, tensorboard/), samples, profiles, checkpoints and the autoencoder stage go here."""
    export_dir: Path | None = None
    """Save the trained pipeline here in the diffusers format (default: ``output_dir/pipeline``)."""
    export_dtype: str | None = None
    """Dtype of the exported weights (float32 if None; float16 / bfloat16 halve the folder)."""
    export_scheduler: str | None = "dpm++2m"
    """Scheduler written to the exported pipeline (same noise schedule as training); None: the fine-tuned
    folder's own scheduler, as it was (from scratch: ``dpm++2m``)."""
    log_every: int = 25
    """Write the loss, learning rate and throughput to metrics.jsonl and tensorboard every this many steps."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: never)."""
    keep_checkpoints: int = 3
    """How many of the latest checkpoints to keep on disk (older ones are deleted)."""
    resume: bool = True
    """Continue from the latest checkpoint in ``output_dir/checkpoints`` if there is one."""
    profile_steps: tuple[int, ...] = ()
    """Steps (0-based) to record a JAX profiler trace of, into ``output_dir/profile``."""
    sample_every: int = 0
    """Generate images from ``sample_prompts`` every this many steps (0: only at the end if exporting)."""
    sample_prompts: tuple[str, ...] = ()
    """Prompts of the sample images (saved under ``output_dir/samples`` and to tensorboard); none: no samples."""
    sample_steps: int = 20
    """Denoising steps of each sample (with ``export_scheduler``)."""
    sample_guidance_scale: float = 4.0
    """Classifier-free guidance scale of the samples."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self):
        for key in ("batch_size", "steps", "log_every", "keep_checkpoints", "resolution", "autoencoder_steps",
                    "autoencoder_batch_size", "sample_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        for key in ("checkpoint_every", "sample_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 0 (0: never)")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed={self.seed} must be in [0, 2**31): it seeds JAX, NumPy and the data order")
        if any(s < 0 for s in self.profile_steps):
            raise ValueError(f"profile_steps={self.profile_steps} must be steps >= 0")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"ema_decay={self.ema_decay} must be in (0, 1)")
        if not 0.0 < self.autoencoder_learning_rate < math.inf:
            raise ValueError(f"autoencoder_learning_rate={self.autoencoder_learning_rate} must be a positive number")
        if not 0.0 <= self.kl_weight < math.inf:
            raise ValueError(f"kl_weight={self.kl_weight} must be a finite number >= 0")
        if not math.isfinite(self.sample_guidance_scale):
            raise ValueError(f"sample_guidance_scale={self.sample_guidance_scale} must be finite (<= 1: no guidance)")
        if not 1 <= self.max_sequence_length <= 512:
            raise ValueError(f"max_sequence_length={self.max_sequence_length} must be in [1, 512] (T5's limit in the "
                             "Flux pipelines)")
        if not math.isfinite(self.guidance_scale):
            raise ValueError(f"guidance_scale={self.guidance_scale} must be finite")
        if self.export_scheduler is not None and self.export_scheduler not in SCHEDULERS:
            raise ValueError(f"export_scheduler={self.export_scheduler!r}; choose one of {list(SCHEDULERS)}")
        try:
            check_dtype(self.export_dtype)
        except ValueError as e:
            raise type(e)(f"export_dtype={self.export_dtype!r}: {e}") from None
        object.__setattr__(self, "tfrecord", tuple(str(p) for p in self.tfrecord))
        object.__setattr__(self, "remat", Remat(self.remat))
        Plan(remat=self.remat, remat_names=self.remat_names)  # a bad remat/remat_names pair raises here
        self._source(require=False)  # conflicting data flags raise now; a missing source when training starts

    @property
    def source(self) -> str:
        """Which data source the flags select: ``digits``, ``synthetic``, ``folder``, ``hf`` or ``tfrecord``.
        Raises ``ValueError`` naming the flags when they select none, several, or set options of another."""
        return self._source(require=True)

    def _source(self, require: bool) -> str | None:
        given = {"data": self.data, "hf_dataset": self.hf_dataset, "tfrecord": self.tfrecord or None}
        given = {k: v for k, v in given.items() if v is not None and v != ""}
        if len(given) > 1:
            raise ValueError("give one data source, got " + " and ".join(f"{k}={v!r}" for k, v in given.items())
                             + f"; keep one of {_SOURCE_FLAGS}")
        if not given:
            if self.model is not None:
                if not require:
                    return None
                raise ValueError(f"fine-tuning needs training data: set one of {_SOURCE_FLAGS}")
            source = "digits"
        elif "hf_dataset" in given:
            source = "hf"
        elif "tfrecord" in given:
            source = "tfrecord"
        else:
            source = self.data if self.data in ("digits", "synthetic") else "folder"
        allowed = {"hf": ("image_column", "caption_column"), "folder": ("image_column", "caption_column"),
                   "tfrecord": ("image_key", "caption_key")}.get(source, ())
        for option in ("image_column", "caption_column", "image_key", "caption_key"):
            if getattr(self, option) is not None and option not in allowed:
                fits = ("the tfrecord source" if option.endswith("_key")
                        else "an hf_dataset or an image folder (data=FOLDER)")
                hint = {"image_column": "image_key", "caption_column": "caption_key",
                        "image_key": "image_column", "caption_key": "caption_column"}[option]
                raise ValueError(f"{option}={getattr(self, option)!r} is for {fits}, but the data source is "
                                 f"{source!r}" + (f"; use {hint}" if hint in allowed else "; remove it"))
        return source


_SOURCE_FLAGS = "data= (digits, synthetic or an image folder), hf_dataset= or tfrecord="


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _text_tokenizers(tokenizer) -> dict:
    """``{batch key: tokenizer}`` of one tokenizer (``input_ids``) or of such a mapping."""
    return dict(tokenizer) if isinstance(tokenizer, dict) else {"input_ids": tokenizer}


def open_source(config: TrainConfig, tokenizer=None):
    """``("arrays", dict)`` for the digits (the whole set in memory; tokenized with ``tokenizer``) or
    ``("source", source)``: the data source the flags select, checked (its files, columns, size) before any model
    is built or compiled."""
    source = config.source
    if source == "digits":
        tokenizers = _text_tokenizers(tokenizer)
        if list(tokenizers) != ["input_ids"]:
            raise DataError(f"data='digits' (the from-scratch digits set) has one tokenizer's ids; this model "
                            f"needs {list(tokenizers)}: train it on an image folder, hf_dataset, tfrecord or synthetic")
        arrays = DigitsSource(config.resolution, tokenizer=tokenizers["input_ids"]).arrays
        check_batch(arrays, where="dataset 'digits'")
        if len(arrays["pixel_values"]) < config.batch_size:
            raise DataError(f"dataset 'digits' has {len(arrays['pixel_values'])} samples, fewer than "
                            f"batch_size={config.batch_size}")
        return "arrays", arrays

    columns = {k: v for k, v in (("image_column", config.image_column), ("caption_column", config.caption_column))
               if v is not None}
    if source == "synthetic":
        source = SyntheticSource(max(1024, config.batch_size), height=config.resolution, width=config.resolution,
                                 seed=config.seed)
    elif source == "hf":
        source = HFDatasetSource(config.hf_dataset, split=config.hf_split, **columns)
    elif source == "tfrecord":
        keys = {k: v for k, v in (("image_key", config.image_key), ("caption_key", config.caption_key))
                if v is not None}
        source = TFRecordSource(config.tfrecord, **keys)
    elif Path(config.data).is_dir():
        source = ImageFolderSource(config.data, **columns)
    else:
        name = config.data.lower()
        hint = ("; for TFRecord files use tfrecord (--tfrecord)" if ".tfrecord" in name else
                "; for a Hugging Face dataset (a Hub id, parquet, json, csv or arrow files) use hf_dataset "
                "(--hf-dataset)")
        raise DataError(f"data={config.data!r} is not 'digits', 'synthetic' or an image folder{hint}")
    if len(source) < config.batch_size:
        raise DataError(f"{source!r} has {len(source)} samples, fewer than batch_size={config.batch_size}")
    return "source", source


def stream(config: TrainConfig, source, tokenizer, *, micro_conditioning: bool = False, **kwargs):
    """:func:`eqxdiff.data.make_dataset` of ``source`` with the run's resolution, crops, flips and seed
    (``kwargs``: its other arguments)."""
    return make_dataset(source, tokenizer=_text_tokenizers(tokenizer), batch_size=config.batch_size,
                        resolution=config.resolution, center_crop=config.center_crop, random_flip=config.random_flip,
                        micro_conditioning=micro_conditioning, seed=config.seed, **kwargs)


def load_data(config: TrainConfig, tokenizer, *, micro_conditioning: bool = False):
    """``("arrays", dict)`` for the digits (the whole set in memory: cacheable, exactly resumable) or
    ``("stream", grain dataset)`` for the other sources (:func:`eqxdiff.data.make_dataset`). Sources check their
    files when built, so bad data fails here, before any model is built or compiled. ``tokenizer``: one, or
    ``{batch key: tokenizer}`` for a model with several text encoders; ``micro_conditioning``: the batches carry
    each image's original size and crop (SDXL)."""
    kind, data = open_source(config, tokenizer)
    if kind == "arrays":
        return kind, data
    return "stream", stream(config, data, tokenizer, micro_conditioning=micro_conditioning)


@dataclasses.dataclass
class Setup:
    """What :func:`build` makes of a run's model: the family's bundle, its tokenizers by component name, the noise
    scheduler the objective draws from, the scheduler samples and the export use unless ``export_scheduler`` names
    another, and the pipeline's ``model_index.json`` options (SDXL's ``force_zeros_for_empty_prompt``)."""

    model: TrainModel
    tokenizers: dict
    noise_scheduler: object
    scheduler: object
    options: dict
    max_sequence_length: int = 512

    @property
    def text_tokenizers(self) -> dict:
        """``{batch key: tokenizer}``, what the data tokenizes captions with."""
        return {t.key: self.tokenizers[t.tokenizer] for t in self.model.TEXT}

    @property
    def text_lengths(self) -> dict:
        """``{batch key: token ids per caption}`` (:meth:`eqxdiff.train.TrainModel.text_lengths`)."""
        return self.model.text_lengths(self.tokenizers, max_sequence_length=self.max_sequence_length)


def build(config: TrainConfig, mesh=None) -> Setup:
    """The run's :class:`Setup`: ``config.model`` loaded (straight onto ``mesh``'s shardings when given) and given
    to its family's bundle (:func:`eqxdiff.train._families.train_family`), or the digits architecture built from
    scratch (its VAE still untrained: :func:`autoencoder_stage`)."""
    if config.model is not None:
        pipe = load_pipeline(config.model, mesh=mesh)
        family = train_family(pipe.CLASS_NAME)
        model, tokenizers, noise_scheduler = family.from_pipeline(
            pipe, guidance_scale=config.guidance_scale, max_sequence_length=config.max_sequence_length)
        return Setup(model, tokenizers, noise_scheduler, pipe.scheduler, dict(pipe.options),
                     config.max_sequence_length)
    tokenizer = character_tokenizer(max_length=32)
    model = build_digits_model(config.architecture, tokenizer, seed=config.seed)
    noise = DDPMScheduler.from_config({**SD_NOISE_SCHEDULE, "prediction_type":
                                       config.objective.prediction_type or "epsilon"})
    return Setup(model, {"tokenizer": tokenizer}, noise, scheduler_from_config(noise.config.to_dict(),
                                                                                name="dpm++2m"), {})


def build_model(config: TrainConfig):
    """``(model, tokenizer, noise_scheduler)`` of :func:`build` (``tokenizer``: the first text encoder's)."""
    setup = build(config)
    return setup.model, next(iter(setup.tokenizers.values())), setup.noise_scheduler


# What the autoencoder stage's VAE depends on (config.json's dotted names): its sizes, the stage's training and data.
AUTOENCODER_SETTINGS = ("architecture.vae_channels", "architecture.latent_channels", "architecture.norm_num_groups",
                        "architecture.image_size", "autoencoder_steps", "autoencoder_batch_size",
                        "autoencoder_learning_rate", "kl_weight", "resolution", "data", "hf_dataset", "tfrecord")


def autoencoder_stage(config: TrainConfig, model: TrainModel, kind: str, data) -> TrainModel:
    """``model`` with its VAE trained by the autoencoder stage (:func:`eqxdiff.train.train_autoencoder`, then the
    latent scaling factor fitted) and saved to ``OUTPUT_DIR/autoencoder``; or the VAE saved there by an earlier run
    of this output folder, reused if that run's ``config.json`` agrees on :data:`AUTOENCODER_SETTINGS` (else
    :class:`~eqxdiff.train.CheckpointMismatchError` listing what differs, before anything is written). A signal
    stops the stage with :class:`~eqxdiff.train.TrainingInterrupted`, nothing of it kept."""
    out = Path(config.output_dir)
    folder = out / "autoencoder"
    if (folder / "config.json").is_file():
        changed = _changed_settings(out / "config.json", _settings(config), keys=AUTOENCODER_SETTINGS)
        if changed:
            raise CheckpointMismatchError(
                f"the autoencoder in {folder} was trained with other settings than this run's; it was not reused "
                f"and nothing was changed. Settings that differ from that run's config.json: {changed}. Run with "
                f"that run's settings, use another output_dir, or delete {folder} (and {out / 'checkpoints'}) to "
                "train a new autoencoder")
        _log(f"autoencoder stage: reusing {folder}")
        return eqx.tree_at(lambda m: m.vae, model, load(folder))
    t0 = time.perf_counter()
    if kind == "arrays":
        batches = ArrayBatches({"pixel_values": data["pixel_values"]}, config.autoencoder_batch_size,
                               seed=config.seed + 1)
        images = data["pixel_values"]
    else:
        batches = iter(data)
        images = next(iter(data))["pixel_values"]
    vae, _ = train_autoencoder(model.vae, batches, steps=config.autoencoder_steps,
                               key=jax.random.key(config.seed + 1), learning_rate=config.autoencoder_learning_rate,
                               kl_weight=config.kl_weight, log_every=max(config.autoencoder_steps // 10, 1),
                               log=_log)
    vae = fit_scaling_factor(vae, images, key=jax.random.key(config.seed + 2))
    save_pretrained(vae, folder)
    _log(f"autoencoder stage: {time.perf_counter() - t0:.0f} s, scaling_factor "
         f"{vae.config.scaling_factor:.4f}, saved to {folder}")
    return eqx.tree_at(lambda m: m.vae, model, vae)


def export_pipeline(model: TrainModel, tokenizer, noise_scheduler, folder, *, scheduler: str | None = "dpm++2m",
                    dtype=None, options: dict | None = None):
    """Save ``model`` (a family's bundle, its text encoders in place) as a diffusers pipeline folder of its family
    (``StableDiffusionPipeline``, ``StableDiffusionXLPipeline``, ``FluxPipeline``) sampling with ``scheduler`` (a
    name, on ``noise_scheduler``'s noise schedule; or a scheduler; ``None``: ``noise_scheduler`` itself).
    ``tokenizer``: one, or ``{component name: tokenizer}``; ``options``: the pipeline's ``model_index.json``
    settings."""
    tokenizers = tokenizer if isinstance(tokenizer, dict) else {"tokenizer": tokenizer}
    if scheduler is None:
        scheduler = noise_scheduler
    elif isinstance(scheduler, str):
        scheduler = scheduler_from_config(noise_scheduler.config.to_dict(), name=scheduler)
    pipe = model.pipeline(tokenizers, scheduler, options=options)
    save_pipeline(pipe, folder, dtype=dtype)
    return pipe


def _sample_scheduler(config: TrainConfig, setup: Setup):
    """The scheduler of samples and of the export: ``export_scheduler`` on the noise schedule, or the folder's."""
    if config.export_scheduler is None:
        return setup.scheduler
    return scheduler_from_config(setup.noise_scheduler.config.to_dict(), name=config.export_scheduler)


def _to_host(tree):
    """``tree``'s arrays in host memory where each is whole on this host (the rest stay where they are)."""
    return jax.tree.map(lambda x: jax.device_get(x) if getattr(x, "is_fully_addressable", True) else x, tree)


def _cache_fingerprint(config: TrainConfig, model: TrainModel) -> dict:
    """What a stream's cache depends on: the data flags, the model and the preprocessing."""
    keys = ("model", "data", "hf_dataset", "hf_split", "image_column", "caption_column", "tfrecord", "image_key",
            "caption_key", "resolution", "center_crop", "random_flip", "seed", "max_sequence_length")
    if config.model is None:  # from scratch: the VAE the autoencoder stage trains
        keys += ("architecture", "autoencoder_steps", "autoencoder_batch_size", "autoencoder_learning_rate",
                 "kl_weight")
    return {**{k: getattr(config, k) for k in keys}, "family": type(model).__name__,
            "processes": jax.process_count(), "process": jax.process_index()}


def run(config: TrainConfig):
    """Train as ``config`` says; returns ``(state, frozen, losses)``."""

    t_start = time.perf_counter()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(config)
    mesh = None if config.mesh is None else make_mesh(config.mesh)
    if config.batch_size % batch_shards(mesh):
        raise DataError(f"batch_size={config.batch_size} must be a multiple of {batch_shards(mesh)}: the mesh "
                        f"{dict(mesh.shape)} splits each batch over its data x fsdp axes; change batch_size or "
                        "the mesh's data/fsdp parallelism")
    source = None if config.source == "digits" else open_source(config)[1]  # bad data fails before any loading
    setup = build(config, mesh)
    model = setup.model
    if source is None:
        kind, data = open_source(config, setup.text_tokenizers)
    else:
        kind, data = "stream", stream(config, source, setup.text_tokenizers, max_length=setup.text_lengths,
                                      micro_conditioning=model.micro_conditioning())
    if config.model is None:
        model = autoencoder_stage(config, model, kind, data)
    cache = config.cache and not config.train_text_encoder
    if kind == "arrays":
        _log(f"data: {len(data['pixel_values'])} samples of {data['pixel_values'].shape[1:]}")
        if cache:
            data = cache_arrays(model, data, log=_log)
        batches = ArrayBatches(data, config.batch_size, seed=config.seed)
    elif cache and config.cache_stream:  # one pass in order, encoded to memory-mapped files; shuffled batches
        one_pass = stream(config, source, setup.text_tokenizers, max_length=setup.text_lengths,
                          micro_conditioning=model.micro_conditioning(), shuffle=False, num_epochs=1,
                          drop_remainder=False)
        data = cache_stream(model, iter(one_pass), out / "cache", size=len(source) // jax.process_count(),
                            fingerprint=_cache_fingerprint(config, model), log=_log)
        batches = ArrayBatches(data, config.batch_size // jax.process_count(), seed=config.seed)
    else:  # a grain stream: encoded every step
        batches = iter(data)
        cache = False
    encoders = {}
    if cache:  # the embeddings are cached: the text encoders leave the devices (back for samples and the export)
        model, encoders = model.without_text_encoders()
        encoders = _to_host(encoders)
        setup = dataclasses.replace(setup, model=model)  # no reference to the encoders' device arrays is left
    if mesh is not None or config.remat is not Remat.NONE:
        model = with_plan(model, Plan(mesh, remat=config.remat, remat_names=config.remat_names))
    if mesh is not None:  # placed before the optimizer state is made, so no device holds a whole copy
        model = shard_params(model, mesh)
    optimizer = make_optimizer(config.optimizer)
    spec = trainable_filter(model, train_text_encoder=config.train_text_encoder)
    state, frozen = init_state(model, optimizer, key=jax.random.key(config.seed), filter_spec=spec,
                               ema=config.ema_decay is not None)
    del model
    if mesh is not None:  # on their final shardings before a checkpoint is restored onto them
        state, frozen, _ = shard_state(state, frozen, mesh)
    # Checkpoints every checkpoint_every steps, and on Ctrl-C / SIGTERM whatever it is.
    checkpointer = Checkpointer(out / "checkpoints", every=config.checkpoint_every, keep=config.keep_checkpoints)
    if config.resume and checkpointer.latest_step() is not None:
        try:
            checkpointer.check_layout(state)
        except CheckpointMismatchError as e:
            changed = _changed_settings(out / "config.json", settings)
            raise CheckpointMismatchError(mismatch_message(e.where, e.differences, changed)) from None
        state = checkpointer.restore(state, batches)
        _log(f"resumed from step {int(state.step)}")
    (out / "config.json").write_text(json.dumps(settings, indent=2))  # only once the run is known to fit
    logger = MetricsLogger(out, total_steps=config.steps, start_step=int(state.step), progress=config.progress)
    scheduler = _sample_scheduler(config, setup)
    sample_fn = None
    if config.sample_prompts:
        sample_fn = _sampler(config, setup, scheduler, frozen, encoders)
    objective = config.objective
    if objective.prediction_type is None:
        default = getattr(setup.noise_scheduler.config, "prediction_type", None)  # flow matching: the velocity
        objective = dataclasses.replace(objective, prediction_type=default)
    try:
        state, losses = fit(state, frozen, batches, steps=config.steps, scheduler=setup.noise_scheduler,
                            objective=objective, optimizer=optimizer, ema_decay=config.ema_decay or 0.0, mesh=mesh,
                            logger=logger, log_every=config.log_every, checkpointer=checkpointer,
                            profile_steps=config.profile_steps, profile_dir=out / "profile",
                            sample_every=config.sample_every, sample_fn=sample_fn)
        if sample_fn is not None:
            logger.images(int(state.step), "samples", sample_fn(state))
    finally:
        logger.close()
        checkpointer.close()
    _log(f"trained to step {int(state.step)} in {time.perf_counter() - t_start:.0f} s (wall, from the start)")
    trained = state.model(_to_host(frozen), use_ema=True)
    trained = _to_host(trained).with_text_encoders(encoders)
    folder = config.export_dir or out / "pipeline"
    export_pipeline(trained, setup.tokenizers, setup.noise_scheduler, folder, scheduler=scheduler,
                    dtype=config.export_dtype, options=setup.options)
    _log(f"exported the pipeline to {folder}; total {time.perf_counter() - t_start:.0f} s")
    return state, frozen, losses


def _sampler(config: TrainConfig, setup: Setup, scheduler, frozen, encoders):
    """``sample(state)``: uint8 images of ``sample_prompts`` from the trained weights (their EMA), through the
    family's pipeline (text encoders put on the devices only while they encode)."""

    def sample(state):
        model = state.model(frozen, use_ema=True).with_text_encoders(encoders)
        pipe = model.pipeline(setup.tokenizers, scheduler, options=setup.options, offload_encoders=bool(encoders))
        extra = {}
        if "max_sequence_length" in inspect.signature(pipe.__call__).parameters:  # Flux: T5 as trained
            extra["max_sequence_length"] = config.max_sequence_length
        return pipe(list(config.sample_prompts), num_inference_steps=config.sample_steps,
                    guidance_scale=config.sample_guidance_scale, seed=0, progress=False, **extra)

    return sample


_PER_RUN = {"steps", "output_dir", "log_every", "checkpoint_every", "keep_checkpoints", "resume", "profile_steps",
            "sample_every", "sample_prompts", "sample_steps", "sample_guidance_scale", "progress", "export_dir",
            "export_dtype", "export_scheduler"}


def _settings(config: TrainConfig) -> dict:
    """``config`` as the run's ``config.json`` holds it (nested dicts, JSON values)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _changed_settings(path: Path, settings: dict, keys: tuple[str, ...] | None = None) -> str:
    """``key: saved -> now`` for the settings (dotted for nested ones) that differ from a saved config.json,
    leaving out those that may change between resumed runs (steps, logging, export ...); only ``keys`` if given."""
    if not path.is_file():
        return ""
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        return ""

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            elif prefix or k not in _PER_RUN:
                yield f"{prefix}{k}", v

    old, new = dict(flat(saved)), dict(flat(settings))
    return "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
                     if old.get(k) != new.get(k) and (keys is None or k in keys))
