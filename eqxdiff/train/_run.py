"""``run(config)``: everything ``scripts/train.py`` does, callable from a notebook.

Data (checked before anything is built), model (a pretrained pipeline, or the from-scratch digits architecture
with its autoencoder stage), optional caching of latents and text embeddings, the train loop with metrics,
checkpoints and samples, and the export of the trained pipeline in the diffusers format.
"""

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from ..data import (ArrayBatches, HFDatasetSource, ImageFolderSource, SyntheticSource, TFRecordSource,
                    character_tokenizer, make_dataset)
from ..data.digits import DigitsSource
from ..loading import load, save_pretrained
from ..parallel import MeshConfig, Plan, Remat, batch_shards, make_mesh, shard_params, with_plan
from ..pipelines import StableDiffusionPipeline, load_pipeline, save_pipeline
from ..schedulers import DDPMScheduler, scheduler_from_config
from ._autoencoder import fit_scaling_factor, train_autoencoder
from ._checkpoint import Checkpointer, CheckpointMismatchError, mismatch_message
from ._data import DataError, cache_arrays, check_batch
from ._digits import SD_NOISE_SCHEDULE, DigitsArchitecture, build_digits_model
from ._loop import fit, shard_state
from ._metrics import MetricsLogger
from ._objectives import Objective
from ._step import LatentDiffusion, OptimizerConfig, init_state, make_optimizer, trainable_filter


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
    objective: Objective = Objective()
    ema_decay: float | None = None
    """Keep an exponential moving average of the trained weights with this decay (exported instead of them)."""
    train_text_encoder: bool = False
    """Train the text encoder too (default: frozen)."""
    cache: bool = True
    """Encode latents and text embeddings once before training (only while the VAE and text encoder are frozen)."""
    architecture: DigitsArchitecture = DigitsArchitecture()
    autoencoder_steps: int = 600
    """From scratch: steps of the autoencoder stage that trains the VAE before the UNet."""
    autoencoder_batch_size: int = 32
    autoencoder_learning_rate: float = 2e-3
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
    export_scheduler: str = "dpm++2m"
    """Scheduler written to the exported pipeline (same betas as training)."""
    log_every: int = 25
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: never)."""
    keep_checkpoints: int = 3
    resume: bool = True
    """Continue from the latest checkpoint in ``output_dir/checkpoints`` if there is one."""
    profile_steps: tuple[int, ...] = ()
    """Steps (0-based) to record a JAX profiler trace of, into ``output_dir/profile``."""
    sample_every: int = 0
    """Generate images from ``sample_prompts`` every this many steps (0: only at the end if exporting)."""
    sample_prompts: tuple[str, ...] = ()
    sample_steps: int = 20
    sample_guidance_scale: float = 4.0
    progress: bool = True

    def __post_init__(self):
        for key in ("batch_size", "steps", "log_every", "keep_checkpoints"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.checkpoint_every < 0 or self.sample_every < 0:
            raise ValueError("checkpoint_every and sample_every must be >= 0")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"ema_decay={self.ema_decay} must be in (0, 1)")
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


_SOURCE_FLAGS = "data (digits, synthetic or an image folder), hf_dataset, tfrecord"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_data(config: TrainConfig, tokenizer):
    """``("arrays", dict)`` for the digits (the whole set in memory: cacheable, exactly resumable) or
    ``("stream", grain dataset)`` for the other sources (:func:`eqxdiff.data.make_dataset`). Sources check their
    files when built, so bad data fails here, before any model is built or compiled."""
    source = config.source
    if source == "digits":

        arrays = DigitsSource(config.resolution, tokenizer=tokenizer).arrays
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
    return "stream", make_dataset(source, tokenizer=tokenizer, batch_size=config.batch_size,
                                  resolution=config.resolution, seed=config.seed)


def build_model(config: TrainConfig):
    """``(model, tokenizer, noise_scheduler)``; from scratch, the VAE is trained first (autoencoder stage) and
    saved to ``output_dir/autoencoder`` so a resumed run reuses it."""

    if config.model is not None:

        pipe = load_pipeline(config.model)
        model = LatentDiffusion(pipe.unet, pipe.text_encoder, pipe.vae, jnp.asarray(
            pipe.tokenizer([""], padding="max_length", max_length=pipe.tokenizer.model_max_length,
                           return_tensors="np").input_ids[0], jnp.int32))
        raw = pipe.scheduler.config.to_dict()
        return model, pipe.tokenizer, DDPMScheduler.from_config(raw)

    tokenizer = character_tokenizer(max_length=32)
    model = build_digits_model(config.architecture, tokenizer, seed=config.seed)
    return model, tokenizer, DDPMScheduler.from_config({**SD_NOISE_SCHEDULE, "prediction_type":
                                                        config.objective.prediction_type or "epsilon"})


def autoencoder_stage(config: TrainConfig, model: LatentDiffusion, kind: str, data) -> LatentDiffusion:
    import equinox as eqx


    folder = Path(config.output_dir) / "autoencoder"
    if (folder / "config.json").is_file():
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


def export_pipeline(model: LatentDiffusion, tokenizer, noise_scheduler, folder, *, scheduler: str = "dpm++2m",
                    dtype=None):
    """Save ``model`` as a diffusers ``StableDiffusionPipeline`` folder sampling with ``scheduler``."""

    sched = scheduler_from_config(noise_scheduler.config.to_dict(), name=scheduler)
    pipe = StableDiffusionPipeline(tokenizer=tokenizer, text_encoder=model.text_encoder, unet=model.unet,
                                   vae=model.vae, scheduler=sched)
    save_pipeline(pipe, folder, dtype=dtype)
    return pipe


def run(config: TrainConfig):
    """Train as ``config`` says; returns ``(state, frozen, losses)``."""

    t_start = time.perf_counter()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = json.loads(json.dumps(dataclasses.asdict(config), default=str))
    mesh = None if config.mesh is None else make_mesh(config.mesh)
    if config.batch_size % batch_shards(mesh):
        raise DataError(f"batch_size={config.batch_size} must be a multiple of {batch_shards(mesh)}: the mesh "
                        f"{dict(mesh.shape)} splits each batch over its data x fsdp axes; change batch_size or "
                        "the mesh's data/fsdp parallelism")
    model, tokenizer, noise_scheduler = build_model(config)
    kind, data = load_data(config, tokenizer)
    if config.model is None:
        model = autoencoder_stage(config, model, kind, data)
    if kind == "arrays":
        _log(f"data: {len(data['pixel_values'])} samples of {data['pixel_values'].shape[1:]}")
        if config.cache and not config.train_text_encoder:
            data = cache_arrays(model, data, log=_log)
        batches = ArrayBatches(data, config.batch_size, seed=config.seed)
    else:  # a grain stream: encoded every step (caching holds a whole dataset in memory)
        batches = iter(data)
    if mesh is not None or config.remat is not Remat.NONE:
        model = with_plan(model, Plan(mesh, remat=config.remat, remat_names=config.remat_names))
    if mesh is not None:  # placed before the optimizer state is made, so no device holds a whole copy
        model = shard_params(model, mesh)
    optimizer = make_optimizer(config.optimizer)
    spec = trainable_filter(model, train_text_encoder=config.train_text_encoder)
    state, frozen = init_state(model, optimizer, key=jax.random.key(config.seed), filter_spec=spec,
                               ema=config.ema_decay is not None)
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
    sample_fn = None
    if config.sample_prompts:
        sample_fn = _sampler(config, tokenizer, noise_scheduler, frozen)
    objective = config.objective
    if objective.prediction_type is None:
        objective = dataclasses.replace(objective, prediction_type=noise_scheduler.config.prediction_type)
    try:
        state, losses = fit(state, frozen, batches, steps=config.steps, scheduler=noise_scheduler,
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
    trained = state.model(jax.device_get(frozen), use_ema=True)
    trained = jax.device_get(trained)
    folder = config.export_dir or out / "pipeline"
    export_pipeline(trained, tokenizer, noise_scheduler, folder, scheduler=config.export_scheduler,
                    dtype=config.export_dtype)
    _log(f"exported the pipeline to {folder}; total {time.perf_counter() - t_start:.0f} s")
    return state, frozen, losses


def _sampler(config: TrainConfig, tokenizer, noise_scheduler, frozen):

    sched = scheduler_from_config(noise_scheduler.config.to_dict(), name=config.export_scheduler)

    def sample(state):
        m = state.model(frozen, use_ema=True)
        pipe = StableDiffusionPipeline(tokenizer=tokenizer, text_encoder=m.text_encoder, unet=m.unet, vae=m.vae,
                                       scheduler=sched)
        return pipe(list(config.sample_prompts), num_inference_steps=config.sample_steps,
                    guidance_scale=config.sample_guidance_scale, seed=0, progress=False)

    return sample


_PER_RUN = {"steps", "output_dir", "log_every", "checkpoint_every", "keep_checkpoints", "resume", "profile_steps",
            "sample_every", "sample_prompts", "sample_steps", "sample_guidance_scale", "progress", "export_dir",
            "export_dtype", "export_scheduler"}


def _changed_settings(path: Path, settings: dict) -> str:
    """``key: saved -> now`` for the settings (dotted for nested ones) that differ from a saved config.json,
    leaving out those that may change between resumed runs (steps, logging, export ...)."""
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
                     if old.get(k) != new.get(k))
