"""The model side of a run: :func:`build` loads a pipeline into its family's bundle with the run's family options
(or builds the digits architecture, whose VAE :func:`autoencoder_stage` trains first), and :func:`export_pipeline`
saves a bundle as its family's pipeline."""

import dataclasses
import time
from pathlib import Path

import equinox as eqx
import jax

from ..data import ArrayBatches, character_tokenizer
from ..loading import load, save_pretrained
from ..pipelines import load_pipeline, save_pipeline
from ..schedulers import (
    SCHEDULER_CLASSES,
    SCHEDULERS,
    DDPMScheduler,
    FlowMatchEulerDiscreteScheduler,
    scheduler_from_config,
)
from ._autoencoder import fit_scaling_factor, train_autoencoder
from ._config import TrainConfig
from ._digits import SD_NOISE_SCHEDULE, build_digits_model
from ._families import train_family
from ._family import FamilyOptions, TrainModel
from ._metrics import log_line
from ._resume import autoencoder_reuse, record_autoencoder
from ._sd import LatentDiffusion
from ._sources import stream


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

    @property
    def text_tokenizers(self) -> dict:
        """``{batch key: tokenizer}``, what the data tokenizes captions with."""
        return {t.key: self.tokenizers[t.tokenizer] for t in self.model.TEXT}

    @property
    def text_lengths(self) -> dict:
        """``{batch key: token ids per caption}`` (:meth:`eqxdiff.train.TrainModel.text_lengths`)."""
        return self.model.text_lengths(self.tokenizers, self.model.options)

    def stream(self, config: TrainConfig, source, **kwargs):
        """:func:`~eqxdiff.train.stream` of ``source`` as the model reads it: captions tokenized by its tokenizers at
        its lengths, with the per-image facts it conditions on (``kwargs``: the rest of ``make_dataset``'s)."""
        return stream(config, source, self.text_tokenizers, max_length=self.text_lengths,
                      image_keys=self.model.IMAGE_KEYS, clean_caption=self.model.CLEAN_CAPTION, **kwargs)


def family_options(given: FamilyOptions, family: type[TrainModel], what: str) -> FamilyOptions:
    """The options ``family``'s bundle trains with: ``given`` (``TrainConfig.family``) when they are that family's,
    its defaults when ``given`` is the bare :class:`FamilyOptions`; ``ValueError`` for another family's (``what``:
    the model, in the message)."""
    if type(given) is family.OPTIONS:
        return given
    if type(given) is FamilyOptions:
        return family.OPTIONS()
    fields = [f.name for f in dataclasses.fields(family.OPTIONS)]
    takes = f"options {fields} ({family.OPTIONS.__name__})" if fields else "no family options"
    raise ValueError(f"family={given!r} holds another family's options, but {what} trains as {family.__name__}, "
                     f"which takes {takes}; leave family at FamilyOptions() (its defaults) or start from that "
                     "family's preset")


def predicting(scheduler, prediction_type: str | None):
    """``scheduler`` with ``prediction_type`` in its config (the objective's: a v-prediction fine-tune of an epsilon
    folder samples, and exports, as v-prediction); as it is for ``None`` (the folder's), for the velocity of flow
    matching, or for a scheduler of rectified flow (:func:`samples_flow`: it predicts the velocity, the one target
    flow matching trains, whose loss refuses another)."""
    current = getattr(scheduler.config, "prediction_type", None)
    if prediction_type in (None, "flow_prediction", current) or current is None or samples_flow(scheduler):
        return scheduler
    return type(scheduler).from_config(scheduler.config.to_dict(), prediction_type=prediction_type)


def build(config: TrainConfig, mesh=None) -> Setup:
    """The run's :class:`Setup`: ``config.model`` loaded (straight onto ``mesh``'s shardings when given) and given
    to its family's bundle (:func:`eqxdiff.train._families.train_family`), its schedulers predicting what the
    objective trains (:func:`predicting`), or the digits architecture built from scratch (its VAE still untrained:
    :func:`autoencoder_stage`)."""
    if config.model is not None:
        pipe = load_pipeline(config.model, mesh=mesh)
        family = train_family(pipe.CLASS_NAME)
        options = family_options(config.family, family, f"model={config.model!r} (a {pipe.CLASS_NAME})")
        model, tokenizers, noise_scheduler = family.from_pipeline(pipe, options)
        trained = config.objective.prediction_type
        return Setup(model, tokenizers, predicting(noise_scheduler, trained), predicting(pipe.scheduler, trained),
                     dict(pipe.options))
    family_options(config.family, LatentDiffusion, "the from-scratch digits architecture")
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


def autoencoder_stage(config: TrainConfig, model: TrainModel, kind: str, data) -> TrainModel:
    """``model`` with its VAE trained by the autoencoder stage (:func:`eqxdiff.train.train_autoencoder`, its own
    progress bar, then the latent scaling factor fitted) and saved to ``OUTPUT_DIR/autoencoder`` with a record of
    the settings that trained it; or the VAE an earlier run saved there, when those settings agree with this run's
    (:func:`~eqxdiff.train._resume.autoencoder_reuse`: else :class:`~eqxdiff.train.CheckpointMismatchError` naming
    them, before anything is written). A signal stops the stage with :class:`~eqxdiff.train.TrainingInterrupted`,
    nothing of it kept."""
    folder = Path(config.output_dir) / "autoencoder"
    if autoencoder_reuse(config):
        log_line(f"autoencoder stage: reusing {folder}")
        return eqx.tree_at(lambda m: m.vae, model, load(folder))
    if (folder / "config.json").is_file():
        log_line(f"note: resume=False: training a new autoencoder in place of {folder}, trained with other settings")
    t0 = time.perf_counter()
    if kind == "arrays":
        batches = ArrayBatches({"pixel_values": data["pixel_values"]}, config.autoencoder_batch_size,
                               seed=config.seed + 1)
        images = data["pixel_values"]
    else:
        batches = iter(data)
        images = next(iter(data))["pixel_values"]
    log_line(f"autoencoder stage: {config.autoencoder_steps} steps training the VAE, before the {config.steps} "
             "training steps")
    vae, _ = train_autoencoder(model.vae, batches, steps=config.autoencoder_steps,
                               key=jax.random.key(config.seed + 1), learning_rate=config.autoencoder_learning_rate,
                               kl_weight=config.kl_weight, log_every=max(config.autoencoder_steps // 10, 1),
                               log=log_line, progress=config.progress)
    vae = fit_scaling_factor(vae, images, key=jax.random.key(config.seed + 2))
    save_pretrained(vae, folder)
    record_autoencoder(config, folder)
    log_line(f"autoencoder stage: {time.perf_counter() - t0:.0f} s, scaling_factor "
             f"{vae.config.scaling_factor:.4f}, saved to {folder}")
    return eqx.tree_at(lambda m: m.vae, model, vae)


def samples_flow(scheduler) -> bool:
    """Whether ``scheduler`` samples rectified flow (flow matching, or flow sigmas / ``flow_prediction``, Wan's
    UniPC) rather than the DDPM noise process."""
    cfg = scheduler.config
    return (isinstance(scheduler, FlowMatchEulerDiscreteScheduler) or bool(getattr(cfg, "use_flow_sigmas", False))
            or getattr(cfg, "prediction_type", None) == "flow_prediction")


def fitting_schedulers(noise_scheduler) -> list[str]:
    """The scheduler names (``export_scheduler``) that, built on ``noise_scheduler``'s config, sample its noise
    process: flow matching's for a flow-matching model, the DDPM-process ones for the others."""
    names = []
    for name in SCHEDULERS:
        try:
            built = scheduler_from_config(noise_scheduler.config.to_dict(), name=name)
        except ValueError:  # a config this scheduler cannot take
            continue
        if samples_flow(built) == samples_flow(noise_scheduler):
            names.append(name)
    return names


def check_scheduler_fits(scheduler, noise_scheduler, what: str) -> None:
    """``ValueError`` when ``scheduler`` samples another noise process than the model trained on
    (``noise_scheduler``'s), naming the schedulers that fit; ``what``: the scheduler, in the message."""
    if samples_flow(scheduler) == samples_flow(noise_scheduler):
        return
    trained, other = ("rectified flow", "the DDPM noise process") if samples_flow(noise_scheduler) else (
        "the DDPM noise process", "rectified flow")
    raise ValueError(f"{what} ({type(scheduler).__name__}) samples {other}, but the model trains on {trained} "
                     f"({type(noise_scheduler).__name__}): its export would not sample it; choose one of "
                     f"{fitting_schedulers(noise_scheduler)} (or None: the folder's scheduler)")


def named_scheduler(name: str, noise_scheduler, option: str):
    """Scheduler ``name`` built on ``noise_scheduler``'s noise schedule, refused where it samples another noise
    process (:func:`check_scheduler_fits`; ``option``: the argument that named it, in the message)."""
    try:
        scheduler = scheduler_from_config(noise_scheduler.config.to_dict(), name=name)
    except ValueError:  # a scheduler whose config refuses the noise schedule's (DDIM: flow_prediction)
        raise ValueError(f"{option}={name!r} cannot sample the model's noise schedule (its config refuses "
                         f"{'a rectified-flow' if samples_flow(noise_scheduler) else 'the DDPM'} one); choose one of "
                         f"{fitting_schedulers(noise_scheduler)} (or None: the folder's scheduler)") from None
    check_scheduler_fits(scheduler, noise_scheduler, f"{option}={name!r}")
    return scheduler


def diffusers_scheduler(scheduler):
    """``scheduler`` as the diffusers scheduler class it is or extends, on the same config: a training subclass
    (Wan's ``ExpertTimesteps``, which keeps one expert's part of the training schedule) exports as its parent, which
    diffusers loads."""
    cls = next(c for c in type(scheduler).__mro__ if SCHEDULER_CLASSES.get(c.__name__) is c)
    return scheduler if cls is type(scheduler) else cls(scheduler.config)


def export_pipeline(model: TrainModel, tokenizer, noise_scheduler, folder, *, scheduler: str | None = "dpm++2m",
                    dtype=None, options: dict | None = None, call_defaults: dict | None = None):
    """Save ``model`` (a family's bundle, its text encoders in place) as a diffusers pipeline folder of its family
    (``StableDiffusionPipeline``, ``StableDiffusionXLPipeline``, ``FluxPipeline``) sampling with ``scheduler`` (a
    name, on ``noise_scheduler``'s noise schedule; or a scheduler; ``None``: ``noise_scheduler``'s diffusers class,
    :func:`diffusers_scheduler`); a scheduler of another noise process is refused (:func:`check_scheduler_fits`).
    ``tokenizer``: one, or ``{component name: tokenizer}``; ``options``: the pipeline's ``model_index.json``
    settings; ``call_defaults``: the folder's recommended call (the run's sampling steps and guidance)."""
    tokenizers = tokenizer if isinstance(tokenizer, dict) else {"tokenizer": tokenizer}
    if scheduler is None:
        scheduler = diffusers_scheduler(noise_scheduler)
    elif isinstance(scheduler, str):
        scheduler = named_scheduler(scheduler, noise_scheduler, "scheduler")
    else:
        check_scheduler_fits(scheduler, noise_scheduler, "scheduler")
    pipe = model.pipeline(tokenizers, scheduler, options=options, call_defaults=call_defaults)
    save_pipeline(pipe, folder, dtype=dtype)
    return pipe


def sample_scheduler(config: TrainConfig, setup: Setup):
    """The scheduler of samples and of the export: ``export_scheduler`` on the noise schedule, or the folder's."""
    if config.export_scheduler is None:
        return setup.scheduler
    return named_scheduler(config.export_scheduler, setup.noise_scheduler, "export_scheduler")
