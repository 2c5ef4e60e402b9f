"""What a training run is told: :class:`TrainConfig` (every field a flag of ``eqxdiff-train``), the run's settings
as its ``config.json`` and each checkpoint hold them (:func:`run_settings`), and what changed since saved ones
(:func:`setting_changes`), split by what a resumed run may change (:data:`RESUMABLE`)."""

import dataclasses
import json
import math
from pathlib import Path

from ..data import FrameSampling
from ..loading import check_dtype
from ..parallel import MeshConfig, Plan, Remat
from ..schedulers import SCHEDULERS
from ._checks import check_choice
from ._digits import DigitsArchitecture
from ._family import FamilyOptions
from ._lora import LoraConfig
from ._objectives import Objective
from ._step import OptimizerConfig


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
    """``hf_dataset``'s image column (default ``image``; ``video`` where the dataset has that and no ``image``: a
    column of clips trains as a video folder does), or the file-name field of an image folder's metadata (default
    ``file_name``)."""
    caption_column: str | None = None
    """``hf_dataset``'s caption column, or the caption field of an image folder's metadata (default ``text``)."""
    tfrecord: tuple[str, ...] = ()
    """TFRecord files of ``tf.train.Example`` records, or folders of ``*.tfrecord*`` files."""
    image_key: str | None = None
    """The ``tfrecord`` feature holding encoded image bytes (default ``image``)."""
    caption_key: str | None = None
    """The ``tfrecord`` feature holding the caption (default ``text``)."""
    resolution: int | tuple[int, int] = 16
    """Training image (and clip) size: one number for square images, or HEIGHT WIDTH (``--resolution 480 832``, as
    diffusers' and the Wan pipelines' height and width); images are resized to cover it and cropped; digits are
    upscaled to it (square only). Both sides must be multiples of the model's size factor (the VAE's downsampling,
    times the transformer's patch for Wan)."""
    batch_size: int = 64
    """Samples per micro-step (over all devices)."""
    steps: int = 1000
    """Micro-steps to train (optimizer updates = steps / optimizer.accumulation_steps); the learning-rate schedule
    spans them unless ``optimizer.total_steps`` is given. From scratch, the autoencoder stage comes first."""
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
    lora: LoraConfig = LoraConfig()
    """LoRA (``--lora.*``): with lora.rank > 0 only adapters of that rank on the lora.targets layers train (they
    alone get gradients and optimizer state; the model's weights stay as loaded), saved as a LoRA file in
    OUTPUT_DIR/lora (or export_dir) instead of a pipeline. Rank 0: a full fine-tune."""
    instance_prompt: str | None = None
    """DreamBooth: the caption of every training image (the data's own captions are not read, and an image folder
    needs none), e.g. 'a photo of sks dog'."""
    class_prompt: str | None = None
    """Prior preservation (DreamBooth, diffusers' --with_prior_preservation): num_class_images images of this prompt,
    drawn by the model itself before training (sample_steps, sample_guidance_scale, export_scheduler), train beside
    the data; the loss is the data's + prior_loss_weight x the class images'. None: none."""
    class_data_dir: Path | None = None
    """Where the class images are kept (default OUTPUT_DIR/class_images): images already there count, missing ones
    are drawn into it one by one, so an interrupted run goes on where it stopped and a later run reuses them."""
    num_class_images: int = 100
    """How many class images prior preservation trains on."""
    prior_loss_weight: float = 1.0
    """The weight of the class images' loss against the data's."""
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
    frames: FrameSampling = FrameSampling()
    """A ``data`` folder of video clips (mp4, webm, gif ...: a folder with clips and no images) with captions, laid
    out as an image folder: which frames of each clip train (``pixel_values`` ``[batch, frames, height, width, 3]``,
    for a video family: Wan). Image sources ignore it."""
    family: FamilyOptions = FamilyOptions()
    """The model family's own training options (``--family.*``: a preset sets its family's, e.g. ``flux-dev``'s
    guidance and T5 length, ``eqxdiff.train.FluxOptions``); ``FamilyOptions()``: the defaults of the family the
    model turns out to be."""
    architecture: DigitsArchitecture = DigitsArchitecture()
    """From scratch (no ``model``): the sizes of the text encoder, UNet and VAE built (``--architecture.*``)."""
    autoencoder_steps: int = 600
    """From scratch: steps of the autoencoder stage, which trains the VAE before any of ``steps`` (whatever
    ``steps`` is; 600 take about 3 minutes on a 2-core CPU, with their own progress bar); a later run in the same
    ``output_dir`` with the same VAE settings reuses ``output_dir/autoencoder``."""
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
    """Scheduler written to the exported pipeline (same noise schedule and prediction type as training; one that
    samples another noise process, such as ``dpm++2m`` for flow matching, is refused naming those that fit); None: the
    fine-tuned folder's own scheduler, predicting what the objective trains (from scratch: ``dpm++2m``)."""
    log_every: int = 25
    """Write the loss, learning rate and throughput to metrics.jsonl and tensorboard every this many steps."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: never)."""
    keep_checkpoints: int = 3
    """How many of the latest checkpoints to keep on disk (older ones are deleted)."""
    resume: bool = True
    """Continue from the latest checkpoint in ``output_dir/checkpoints`` if there is one. Only these settings may
    differ from the ones it was saved with (each change printed as a note): steps, log_every, progress,
    profile_steps, checkpoint_every, keep_checkpoints, sample_every, sample_prompts, sample_steps,
    sample_guidance_scale, export_dir, export_dtype, export_scheduler, lora.format (what the LoRA file is written
    as), mesh and remat / remat_names; any other
    change is refused before anything is loaded. A finished run (its last checkpoint at ``steps``) is not trained
    again. False: start over, replacing the earlier run's checkpoints."""
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
        for key in ("batch_size", "steps", "log_every", "keep_checkpoints", "autoencoder_steps",
                    "autoencoder_batch_size", "sample_steps", "num_class_images"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        object.__setattr__(self, "resolution", _resolution(self.resolution))
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
        if not 0.0 <= self.prior_loss_weight < math.inf:
            raise ValueError(f"prior_loss_weight={self.prior_loss_weight} must be a finite number >= 0")
        if not math.isfinite(self.sample_guidance_scale):
            raise ValueError(f"sample_guidance_scale={self.sample_guidance_scale} must be finite (<= 1: no guidance)")
        if not isinstance(self.family, FamilyOptions):
            raise TypeError(f"family={self.family!r} must be a family's options (an eqxdiff.train.FamilyOptions, "
                            "e.g. FluxOptions(guidance_scale=3.5))")
        if self.export_scheduler is not None:
            check_choice("export_scheduler", self.export_scheduler, SCHEDULERS)
        try:
            check_dtype(self.export_dtype)
        except ValueError as e:
            raise type(e)(f"export_dtype={self.export_dtype!r}: {e}") from None
        object.__setattr__(self, "tfrecord", tuple(str(p) for p in self.tfrecord))
        object.__setattr__(self, "remat", Remat(self.remat))
        Plan(remat=self.remat, remat_names=self.remat_names)  # a bad remat/remat_names pair raises here
        source = self._source(require=False)  # conflicting data flags raise now; a missing one when training starts
        if source == "digits" and not isinstance(self.resolution, int):
            raise ValueError(f"resolution={self.resolution} is not square, but data='digits' upscales square digits: "
                             "give one size (e.g. resolution=16)")
        self._check_lora_and_dreambooth()

    def _check_lora_and_dreambooth(self) -> None:
        if not isinstance(self.lora, LoraConfig):
            raise TypeError(f"lora={self.lora!r} must be an eqxdiff.train.LoraConfig")
        for key in ("instance_prompt", "class_prompt"):
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise ValueError(f"{key}={getattr(self, key)!r} is empty; give a prompt (or None)")
        if self.class_data_dir is not None:
            object.__setattr__(self, "class_data_dir", Path(self.class_data_dir))
            if self.class_prompt is None:
                raise ValueError(f"class_data_dir={str(self.class_data_dir)!r} holds prior preservation's class "
                                 "images; give class_prompt too (or leave class_data_dir out)")
        scratch = [] if self.model is None else [f"{k}={v!r}" for k, v in flat_settings(run_settings(self)).items()
                                                 if k.split(".")[0] in _SCRATCH and v != _SCRATCH_DEFAULTS[k]]
        if scratch:
            raise ValueError(f"{', '.join(scratch)} set{'s' * (len(scratch) == 1)} the from-scratch digits "
                             f"architecture and its autoencoder stage, but model={self.model!r} is fine-tuned as it "
                             "is: drop them (or the model, to train from scratch)")
        if self.model is None:
            what = {"lora.rank": self.lora.rank if self.lora.enabled else None, "class_prompt": self.class_prompt}
            given = {k: v for k, v in what.items() if v is not None}
            if given:
                name, value = next(iter(given.items()))
                raise ValueError(f"{name}={value!r} needs a pretrained model: give model= (the from-scratch digits "
                                 "architecture trains in full, without prior preservation)")
        if self.lora.enabled and self.lora.text_encoders and self.train_text_encoder:
            raise ValueError("train_text_encoder=True trains the text encoders' weights in full, lora.text_encoders="
                             "True puts adapters on them instead; keep one")
        if self.instance_prompt is not None and self._source(require=False) == "digits":
            raise ValueError("instance_prompt captions the images of an image source; data='digits' comes "
                             f"tokenized: give {_SOURCE_FLAGS.replace('digits, ', '')}")

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)`` of the training images (and clips): :attr:`resolution`'s."""
        r = self.resolution
        return (r, r) if isinstance(r, int) else r

    @property
    def export_folder(self) -> Path:
        """Where the trained result goes: ``export_dir``, else ``OUTPUT_DIR/lora`` (a LoRA file) or
        ``OUTPUT_DIR/pipeline`` (a pipeline folder)."""
        return Path(self.export_dir or Path(self.output_dir) / ("lora" if self.lora.enabled else "pipeline"))

    @property
    def export_file(self) -> Path:
        """The file whose presence says the export is done: the LoRA file, or the pipeline's ``model_index.json``."""
        return self.export_folder / (self.lora.weight_name if self.lora.enabled else "model_index.json")

    @property
    def trains_text_encoders(self) -> bool:
        """Whether the text encoders change (their weights, or LoRA adapters on them): then nothing is cached."""
        return self.train_text_encoder or (self.lora.enabled and self.lora.text_encoders)

    def resolved(self) -> "TrainConfig":
        """This config with what it leaves to the run filled in: the optimizer's schedule spans ``steps`` unless
        ``optimizer.total_steps`` is given."""
        optimizer = self.optimizer.spanning(self.steps)
        return self if optimizer is self.optimizer else dataclasses.replace(self, optimizer=optimizer)

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


# What only a from-scratch run (model=None) reads: a fine-tune would drop them without a word.
_SCRATCH = ("architecture", "autoencoder_steps", "autoencoder_batch_size", "autoencoder_learning_rate", "kl_weight")
_SOURCE_FLAGS = "data= (digits, synthetic or an image folder), hf_dataset= or tfrecord="


def _resolution(value) -> int | tuple[int, int]:
    """``TrainConfig.resolution`` checked: one size >= 1, or ``(height, width)`` (a sequence of two; equal sides are
    one size, so a run saved as square reads the same)."""
    if isinstance(value, int) and value < 1:
        raise ValueError(f"resolution={value} must be >= 1 (one size: square; or two: height and width)")
    sides = [value] if isinstance(value, int) else list(value) if isinstance(value, (tuple, list)) else None
    if sides is None or len(sides) not in (1, 2) or not all(isinstance(s, int) and s >= 1 for s in sides):
        raise ValueError(f"resolution={value!r} must be one size >= 1 (square) or two, height and width, each >= 1 "
                         "(e.g. resolution=(480, 832), --resolution 480 832)")
    return sides[0] if len(set(sides)) == 1 else tuple(sides)


# What a resumed run may change (dotted names, or a nested config whose every field may), each change printed as a
# note: how far the run goes (``steps``), what it writes, how often and where (logging, profiles, checkpoints, samples,
# the export), and how the same computation is laid out on the devices (``mesh``, ``remat``). None of them changes
# what a step computes from the restored state and the next batch; every other setting (the model, the data and its
# order, the objective, the optimizer and its schedule, the seed, caching) is refused by eqxdiff.train.resume_point.
RESUMABLE = ("steps", "output_dir", "resume", "progress", "log_every", "profile_steps", "checkpoint_every",
             "keep_checkpoints", "sample_every", "sample_prompts", "sample_steps", "sample_guidance_scale",
             "export_dir", "export_dtype", "export_scheduler", "lora.format", "mesh", "remat", "remat_names")
_UNREPORTED = ("output_dir", "resume")  # the same folder, spelled another way; resuming itself


def run_settings(config: TrainConfig) -> dict:
    """``config`` as the run's ``config.json`` and each checkpoint hold it (nested dicts, JSON values), with what it
    leaves to the run filled in (:meth:`TrainConfig.resolved`)."""
    return json.loads(json.dumps(dataclasses.asdict(config.resolved()), default=str))


def with_defaults(saved: dict) -> dict:
    """``saved`` settings with those it lacks at their defaults: settings eqxdiff added after it was written (LoRA,
    DreamBooth), which an older run trained without, i.e. as their defaults do."""
    out = dict(saved)
    for key, value in run_settings(TrainConfig()).items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict) and key != "family":
            out[key] = {**value, **out[key]}
    return out


def flat_settings(settings: dict, prefix: str = "") -> dict:
    """``{dotted name: value}`` of :func:`run_settings`' nested dicts."""
    out = {}
    for k, v in settings.items():
        if isinstance(v, dict):
            out.update(flat_settings(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


_SCRATCH_DEFAULTS = {k: v for k, v in flat_settings(json.loads(json.dumps(dataclasses.asdict(TrainConfig()),
                                                                           default=str))).items()
                     if k.split(".")[0] in _SCRATCH}


def setting_changes(saved: dict, settings: dict, keys: tuple[str, ...] | None = None) -> dict:
    """``{dotted name: (saved, now)}`` of the settings (:func:`run_settings`, or :func:`flat_settings`) that differ
    from ``saved`` (only ``keys``, if given); a nested config set on one side only (``mesh``: ``None`` and sizes) is
    one change."""
    changes = {}

    def walk(old: dict, new: dict, prefix: str):
        for k in sorted(old.keys() | new.keys()):
            a, b = old.get(k), new.get(k)
            if isinstance(a, dict) and isinstance(b, dict):
                walk(a, b, f"{prefix}{k}.")
            elif a != b and (keys is None or prefix + k in keys):
                changes[prefix + k] = (a, b)

    walk(saved, settings, "")
    return changes


def resumable(name: str) -> bool:
    """Whether setting ``name`` (dotted) may change when a run resumes (:data:`RESUMABLE`)."""
    return name in RESUMABLE or name.split(".", 1)[0] in RESUMABLE


def reported(name: str) -> bool:
    """Whether a resumed run notes a change of setting ``name`` (not of ``output_dir`` or ``resume``)."""
    return name not in _UNREPORTED


def describe_changes(changes: dict) -> str:
    """``name=saved -> now, ...`` of :func:`setting_changes`, each value at most a few dozen characters (a long list
    or text is summarised)."""
    return ", ".join(f"{k}={_short(old)} -> {_short(new)}" for k, (old, new) in changes.items())


def _short(value, width: int = 40) -> str:
    text = repr(value)
    if len(text) <= width:
        return text
    if isinstance(value, list):
        return f"[{_short(value[0], width)}, ... {len(value)} items]"
    if isinstance(value, dict):
        key = next(iter(value))
        return f"{{{key!r}: {_short(value[key], width)}, ... {len(value)} keys}}"
    if isinstance(value, str):
        return repr(value[:width - 8] + "...")
    return text[:width - 3] + "..."


def changed_settings(path: Path, settings: dict) -> str:
    """:func:`describe_changes` of the settings that may not change on resume and differ from a saved
    ``config.json`` (what a checkpoint saved without its settings, by eqxdiff before it stored them, is compared
    with); ``""`` when there is no readable file."""
    try:
        saved = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        saved = {}
    changes = setting_changes(with_defaults(saved), settings) if saved else {}
    return describe_changes({k: v for k, v in changes.items() if not resumable(k)})
