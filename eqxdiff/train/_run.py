"""``run(config)``: everything ``eqxdiff-train`` does, callable from a notebook.

Data (checked before anything is built: :mod:`._sources`), model (a pretrained pipeline of any family eqxdiff
trains, through its :class:`~eqxdiff.train.TrainModel` bundle and the run's family options; or the from-scratch
digits architecture with its autoencoder stage: :mod:`._setup`), optional caching of latents and text embeddings
(in memory, or for a stream to memory-mapped files), the train loop with metrics, checkpoints and samples, and the
export of the trained pipeline in the diffusers format. Nothing here names a family: the bundle says what trains,
how text is encoded, what the denoiser is called with, what its pipeline's call takes as trained and which pipeline
calls draw the samples (:meth:`~eqxdiff.train.TrainModel.sample_calls`, given the dataset's first example); the noise
scheduler says which objective (DDPM or flow matching).
"""

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import grain
import jax
import numpy as np

from ..data import ArrayBatches
from ..parallel import Plan, Remat, batch_shards, make_mesh, shard_params, with_plan
from ._checkpoint import Checkpointer, CheckpointMismatchError, mismatch_message
from ._config import TrainConfig, changed_settings, run_settings
from ._data import DataError, cache_arrays, cache_stream
from ._dreambooth import PriorBatches, class_images
from ._family import TrainModel
from ._loop import fit, shard_state
from ._lora import add_lora, lora_filter, save_lora
from ._metrics import MetricsLogger, log_line
from ._precheck import check_data_kind, check_model
from ._resume import ResumePoint, autoencoder_reuse, resume_point
from ._setup import Setup, autoencoder_stage, build, export_pipeline, sample_scheduler
from ._sources import open_source
from ._step import init_state, make_optimizer, trainable_filter


def run(config: TrainConfig):
    """Train as ``config`` says; returns ``(state, frozen, losses)`` (``losses``: of the steps this call ran).

    An earlier run in ``output_dir`` is resumed from its latest checkpoint when the settings saved with it agree with
    ``config`` (:func:`eqxdiff.train.resume_point`; checked, with an earlier autoencoder stage's settings, before
    anything is loaded or written). A run its last checkpoint shows trained to ``steps`` and exported has nothing to
    do: ``(None, None, [])``; trained but not exported as asked, it is restored and exported."""
    t_start = time.perf_counter()
    point = resume_point(config)  # a refused change raises here, before anything is loaded or written
    if config.model is None:
        autoencoder_reuse(config)  # so does an earlier autoencoder stage's VAE trained otherwise
    family = check_model(config)  # the folder's configs against the options, objective and schedulers: unloaded
    check_data_kind(config, family)  # a data folder of clips for a video family, of images for the others
    config = config.resolved()
    out = Path(config.output_dir)
    if point is not None:
        if point.note:
            log_line(f"note: {point.note}")
        if point.step >= config.steps:
            done = point.finished(config)
            log_line(f"already trained to step {point.step} ({point.folder}); "
                     + ("nothing to do" if done else "exporting it"))
            if done:
                return None, None, []
    out.mkdir(parents=True, exist_ok=True)
    mesh = None if config.mesh is None else make_mesh(config.mesh)
    shards = batch_shards(mesh)
    if config.batch_size % shards:
        fits = max(shards, round(config.batch_size / shards) * shards)
        raise DataError(f"batch_size={config.batch_size} must be a multiple of {shards}: the mesh "
                        f"{dict(mesh.shape)} splits each batch over its data x fsdp axes; use batch_size={fits} (or "
                        f"another multiple of {shards}), or change the mesh's data/fsdp parallelism")
    source = None if config.source == "digits" else open_source(config)[1]  # bad data fails before any loading
    if source is not None:
        check_data_kind(config, family, source)  # a Hugging Face dataset or TFRecords: known once opened
    setup = build(config, mesh)
    classes = class_images(config, setup) if config.class_prompt is not None else None  # drawn by the model itself
    setup, batches, encoders = _training_data(config, setup, source, classes)
    optimizer = make_optimizer(config.optimizer)
    state, frozen = _initial_state(config, setup.model, optimizer, mesh)
    # Checkpoints every checkpoint_every steps, at the end, and on Ctrl-C / SIGTERM whatever it is.
    settings = run_settings(config)
    checkpointer = Checkpointer(out / "checkpoints", every=config.checkpoint_every, keep=config.keep_checkpoints,
                                settings=settings)
    state = _restore(config, point, checkpointer, state, batches)
    (out / "config.json").write_text(json.dumps(settings, indent=2))  # only once the run is known to fit
    logger = MetricsLogger(out, total_steps=config.steps, start_step=int(state.step), progress=config.progress)
    scheduler = sample_scheduler(config, setup)
    sample_fn = _sampler(config, setup, scheduler, frozen, encoders, source) if config.sample_prompts else None
    objective = config.objective
    if objective.prediction_type is None:
        default = getattr(setup.noise_scheduler.config, "prediction_type", None)  # flow matching: the velocity
        objective = dataclasses.replace(objective, prediction_type=default)
    start, t_fit = int(state.step), time.perf_counter()
    try:
        state, losses = fit(state, frozen, batches, steps=config.steps, scheduler=setup.noise_scheduler,
                            objective=objective, optimizer=optimizer, ema_decay=config.ema_decay or 0.0, mesh=mesh,
                            logger=logger, log_every=config.log_every, checkpointer=checkpointer,
                            profile_steps=config.profile_steps, profile_dir=out / "profile",
                            sample_every=config.sample_every, sample_fn=sample_fn)
        if int(state.step) > start:  # this process's part of the run
            log_line(f"trained steps {start}-{int(state.step)} in {time.perf_counter() - t_fit:.0f} s")
        if sample_fn is not None:
            logger.images(int(state.step), "samples", *sample_fn(state))
    finally:
        logger.close()
        checkpointer.close()
    trained = state.model(_to_host(frozen), use_ema=True)
    trained = _to_host(trained).with_text_encoders(encoders)
    folder = config.export_folder
    if config.lora.enabled:
        what = save_lora(trained, config.lora, config.export_file, dtype=config.export_dtype)
    else:
        export_pipeline(trained, setup.tokenizers, setup.noise_scheduler, folder, scheduler=scheduler,
                        dtype=config.export_dtype, options=setup.options,
                        call_defaults={"num_inference_steps": config.sample_steps,  # the recipe the run sampled with
                                       "guidance_scale": config.sample_guidance_scale})
        what = f"the pipeline to {folder}"
    log_line(f"exported {what}; total {time.perf_counter() - t_start:.0f} s")
    return state, frozen, losses


def _restore(config: TrainConfig, point: ResumePoint | None, checkpointer: Checkpointer, state, batches):
    """``state`` (and ``batches``' position) restored from the checkpoint at ``point``; with ``resume=False``, the
    earlier run's checkpoints are removed instead (a run that starts over saves its own from step 0, which orbax
    would not write beside a later step). A checkpoint whose arrays do not fit ``state`` is refused with the list."""
    if not config.resume:
        removed = checkpointer.clear()
        if removed:
            log_line(f"note: resume=False: removed the earlier run's checkpoints {removed} in {checkpointer.directory}")
        return state
    if point is None:
        return state
    try:
        checkpointer.check_layout(state, point.step)
    except CheckpointMismatchError as e:
        changed = "" if point.settings is not None else changed_settings(
            Path(config.output_dir) / "config.json", run_settings(config))
        raise CheckpointMismatchError(mismatch_message(e.where, e.differences, changed)) from None
    state = checkpointer.restore(state, batches, step=point.step)
    log_line(f"resumed from step {int(state.step)}")
    return state


def _training_data(config: TrainConfig, setup: Setup, source, classes=None):
    """``(setup, batches, encoders)``: the batches the run trains on (``source``, or the digits when ``None``; with
    prior preservation's ``classes`` beside them: :class:`~eqxdiff.train._dreambooth.PriorBatches`), after the
    from-scratch autoencoder stage, cached where the encoders are frozen (in memory; a stream with ``cache_stream``
    to ``OUTPUT_DIR/cache``, the class images to ``OUTPUT_DIR/cache_class``). With a cache the text encoders leave
    the bundle (``encoders``, in host memory: back for samples and the export) and ``setup`` holds the bundle
    without them."""
    out = Path(config.output_dir)
    if source is None:
        kind, data = open_source(config, setup.text_tokenizers)
    else:
        kind, data = "stream", setup.stream(config, source)
    model = setup.model
    if config.model is None:
        model = autoencoder_stage(config, model, kind, data)
    cache = config.cache and not config.trains_text_encoders
    if kind == "arrays":
        log_line(f"data: {len(data['pixel_values'])} samples of {data['pixel_values'].shape[1:]}")
        if cache:
            data = cache_arrays(model, data, log=log_line)
        batches = ArrayBatches(data, config.batch_size, seed=config.seed)
    else:
        cache = cache and config.cache_stream  # else a grain stream, encoded every step
        batches = _stream_batches(config, setup, model, source, data, cache, out / "cache", config.seed)
    if classes is not None:
        files = [str(p) for p in classes.source.paths[:len(classes)]]
        fingerprint = {"class_images": [(p, os.path.getsize(p)) for p in files], "class_prompt": config.class_prompt}
        stream = setup.stream(config, classes, seed=config.seed + 1)
        class_batches = _stream_batches(config, setup, model, classes, stream, cache, out / "cache_class",
                                        config.seed + 1, fingerprint)
        batches = PriorBatches(batches, class_batches, config.prior_loss_weight)
    encoders = {}
    if cache:  # the embeddings are cached: the text encoders leave the devices (back for samples and the export)
        model, encoders = model.without_text_encoders()
        encoders = _to_host(encoders)
    return dataclasses.replace(setup, model=model), batches, encoders  # no reference to the encoders is left


def _stream_batches(config: TrainConfig, setup: Setup, model: TrainModel, source, data, cache: bool, folder: Path,
                    seed: int, fingerprint: dict | None = None):
    """A stream's batches: with ``cache``, one pass in order encoded to memory-mapped files in ``folder`` (reused by a
    run of the same ``fingerprint``) served in shuffled batches (seeded ``seed``); else the grain ``data``'s."""
    if not cache:
        return iter(data)
    one_pass = setup.stream(config, source, shuffle=False, num_epochs=1, drop_remainder=False, seed=seed)
    arrays = cache_stream(model, iter(one_pass), folder, size=len(source) // jax.process_count(),
                          fingerprint={**_cache_fingerprint(config, model), **(fingerprint or {})}, log=log_line)
    return ArrayBatches(arrays, config.batch_size // jax.process_count(), seed=seed)


def _initial_state(config: TrainConfig, model: TrainModel, optimizer, mesh):
    """``(state, frozen)`` of ``model`` (its plan set for ``mesh`` and remat, its weights placed on the mesh before
    the optimizer state is made, so no device holds a whole copy), on their final shardings before a checkpoint is
    restored onto them. With LoRA the adapters join it first, and they alone train (:func:`lora_filter`): every
    weight of the model stays as loaded, outside the optimizer state."""
    if config.lora.enabled:
        model = add_lora(model, config.lora, seed=config.seed)
    if mesh is not None or config.remat is not Remat.NONE:
        model = with_plan(model, Plan(mesh, remat=config.remat, remat_names=config.remat_names))
    if mesh is not None:
        model = shard_params(model, mesh)
    if config.lora.enabled:
        spec = lora_filter(model)
    else:
        spec = trainable_filter(model, train_text_encoder=config.train_text_encoder)
    state, frozen = init_state(model, optimizer, key=jax.random.key(config.seed), filter_spec=spec,
                               ema=config.ema_decay is not None)
    if mesh is not None:
        state, frozen, _ = shard_state(state, frozen, mesh)
    return state, frozen


def _to_host(tree):
    """``tree``'s arrays in host memory where each is whole on this host (the rest stay where they are)."""
    return jax.tree.map(lambda x: jax.device_get(x) if getattr(x, "is_fully_addressable", True) else x, tree)


def _cache_fingerprint(config: TrainConfig, model: TrainModel) -> dict:
    """What a stream's cache depends on: the data flags, the model, its family options and the preprocessing."""
    keys = ("model", "data", "hf_dataset", "hf_split", "image_column", "caption_column", "tfrecord", "image_key",
            "caption_key", "instance_prompt", "resolution", "center_crop", "random_flip", "frames", "seed")
    if config.model is None:  # from scratch: the VAE the autoencoder stage trains
        keys += ("architecture", "autoencoder_steps", "autoencoder_batch_size", "autoencoder_learning_rate",
                 "kl_weight")
    return {**{k: getattr(config, k) for k in keys}, "family": type(model).__name__,
            "family_options": dataclasses.asdict(model.options), "processes": jax.process_count(),
            "process": jax.process_index()}


def _sampler(config: TrainConfig, setup: Setup, scheduler, frozen, encoders, source=None):
    """``sample(state)``: uint8 images (videos) of ``sample_prompts`` from the trained weights (their EMA) and their
    frame rate (a video pipeline's ``default_fps``, else ``None``), drawn by
    the pipeline calls the family asks for (:meth:`~eqxdiff.train.TrainModel.sample_calls`, decided here, before
    training: its pipeline on the prompts by default; Wan 2.2 TI2V's image-to-video pipeline too, on the first frame
    of the dataset's first clip, ``source``'s: :func:`first_example`), each call's outputs after the previous one's
    along the batch axis. Text encoders are put on the devices only while they encode; each call takes the options
    the pipeline takes as trained (:meth:`~eqxdiff.train.TrainModel.call_options`) and the family's sample size
    (videos: as the clips trained)."""
    calls = setup.model.sample_calls(lambda: first_example(config, setup, source))

    def sample(state):
        model = state.model(frozen, use_ema=True).with_text_encoders(encoders)
        outputs, fps = [], None
        for call in calls:
            pipe = model.pipeline(setup.tokenizers, scheduler, options=setup.options, offload_encoders=bool(encoders),
                                  class_name=call.pipeline)
            outputs.append(pipe(prompt=list(config.sample_prompts), **call.inputs,
                                num_inference_steps=config.sample_steps, guidance_scale=config.sample_guidance_scale,
                                seed=0, progress=False, **model.call_options(), **model.sample_size(config)))
            fps = getattr(pipe, "default_fps", None)  # a video pipeline's: the checkpoint's frame rate
        return (outputs[0] if len(outputs) == 1 else np.concatenate([np.asarray(o) for o in outputs])), fps

    return sample


def first_example(config: TrainConfig, setup: Setup, source=None) -> dict[str, np.ndarray]:
    """The dataset's first training example as a batch of 1, as the run's data gives it before any cache (pixels at
    the run's size and frames, token ids), the same on every host: ``source``'s first record (``None``: the one
    ``config`` selects) through the run's preprocessing, unshuffled."""
    if source is None:
        source = open_source(config, setup.text_tokenizers)[1]
    if isinstance(source, Mapping):  # the digits, in memory
        return {k: np.asarray(v[:1]) for k, v in source.items()}
    one = setup.stream(dataclasses.replace(config, batch_size=1), source, shuffle=False, num_epochs=1,
                       drop_remainder=False, shard_options=grain.sharding.NoSharding())
    return {k: np.asarray(v) for k, v in next(iter(one)).items()}
