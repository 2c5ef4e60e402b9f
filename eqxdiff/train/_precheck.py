"""What :func:`eqxdiff.train.run` (and ``eqxdiff-train`` before it) checks of a run's model before anything loads,
from a local pipeline folder's ``model_index.json`` and ``scheduler/scheduler_config.json`` (a Hub id is checked
once it loads): the family trains it, with options of that family that the folder can take
(:meth:`~eqxdiff.train.TrainModel.check_folder`); the objective and ``export_scheduler`` fit its noise process
(DDPM or rectified flow); the training size fits the folder's VAE (and a video transformer's patches); its data is
what the family trains on (video clips or images, ``frames`` only for clips); and prior preservation is asked only of
an image family. The from-scratch digits architecture is checked the same
way, without a folder."""

import dataclasses
from pathlib import Path

from ..data import VIDEO_EXTENSIONS, FrameSampling, holds_videos
from ..loading import PACKAGED_MODELS, read_config, resolve_folder
from ..schedulers import DDPMScheduler
from ._config import TrainConfig
from ._data import DataError
from ._digits import SD_NOISE_SCHEDULE
from ._families import train_family
from ._family import TrainModel
from ._objectives import check_objective
from ._sd import LatentDiffusion
from ._setup import family_options, named_scheduler, predicting


def local_index(model: str) -> dict | None:
    """The ``model_index.json`` of ``model`` when it is a pipeline folder on this machine (or a model shipped with
    eqxdiff); ``None`` for a Hub id (read when it loads) or a folder without one (loading says what it lacks)."""
    if not (Path(model).expanduser().is_dir() or model in PACKAGED_MODELS):
        return None
    index = resolve_folder(model) / "model_index.json"
    return read_config(index.parent, index.name) if index.is_file() else None


def check_model(config: TrainConfig) -> type[TrainModel] | None:
    """The family ``config`` trains (``None`` for a Hub id, checked when it loads), after checking what its
    folder's configs say without loading a weight; a ``ValueError`` naming the setting and the fix otherwise."""
    if config.model is None:
        family, noise = LatentDiffusion, DDPMScheduler.from_config(SD_NOISE_SCHEDULE)
    else:
        index = local_index(config.model)
        if index is None or index.get("_class_name") is None:
            return None
        name = index["_class_name"]
        family = train_family(name)
        options = family_options(config.family, family, f"model={config.model!r} (a {name})")
        family.check_folder(options, index)
        root = resolve_folder(config.model)
        if family.VIDEO:
            _check_clip_shape(config, family, root)
        elif (root / "vae" / "config.json").is_file():
            factor = 2 ** (len(read_config(root / "vae").get("block_out_channels", (0,) * 4)) - 1)
            check_size(config, factor, f"the VAE downsamples by {factor}")
        if not (root / "scheduler" / "scheduler_config.json").is_file():
            return family  # loading says what the folder lacks
        noise = family.NOISE_SCHEDULER.from_config(read_config(root / "scheduler", "scheduler_config.json"))
    check_objective(config.objective, noise)
    if config.export_scheduler is not None:
        named_scheduler(config.export_scheduler, predicting(noise, config.objective.prediction_type),
                        "export_scheduler")
    frames = [f"frames.{f.name}={getattr(config.frames, f.name)}" for f in dataclasses.fields(FrameSampling)
              if getattr(config.frames, f.name) != f.default]
    if frames and not family.VIDEO:
        raise ValueError(f"{', '.join(frames)} pick{'s' * (len(frames) == 1)} the frames of video clips, but "
                         f"{family.__name__} trains on images: leave {'it' if len(frames) == 1 else 'them'} out")
    if config.class_prompt is not None and family.VIDEO:
        raise ValueError(f"class_prompt={config.class_prompt!r} asks for prior preservation, whose class images the "
                         f"model draws, but {family.__name__} trains on video clips: leave class_prompt out (prior "
                         "preservation trains image models)")
    return family


def _check_clip_shape(config: TrainConfig, family: type[TrainModel], root: Path) -> None:
    """The clips' frame count and size are ones the folder's VAE and transformer take (its pipeline's limits, read
    from the component configs), as ``eqxdiff-train`` checks a folder of clips."""
    limits = family.pipeline_class().folder_limits(
        lambda path: read_config(root, path) if (root / path).is_file() else None)
    check_frame_count(config.frames.count, limits.frame_factor)
    check_size(config, limits.size_factor, limits.why_size())


def library_spelling(field: str, value) -> str:
    """How the library's errors name a setting's value (``resolution=(32, 48)``); ``eqxdiff-train`` passes its flags'
    spelling (``--resolution 32 48``) to the checks below."""
    return f"{field}={value}"


def check_frame_count(count: int, factor: int | None, spell=library_spelling, error: type = ValueError) -> None:
    """``frames.count`` is 1 + ``factor`` k (the VAE's temporal compression), else ``error`` naming the counts
    either side (``spell``: how the message names the setting)."""
    if factor and (count - 1) % factor:
        low = 1 + (count - 1) // factor * factor
        raise error(f"{spell('frames.count', count)} must be 1 + {factor}k (the VAE keeps the first frame and "
                    f"compresses each {factor} after it into one latent frame); try {spell('frames.count', low)} or "
                    f"{low + factor}")


def check_size(config: TrainConfig, factor: int | None, why: str, spell=library_spelling,
               error: type = ValueError) -> None:
    """Both sides of ``resolution`` are multiples of ``factor`` (``why``), else ``error`` naming the nearest size
    that is (the lower one on a tie; ``spell``: how the message names the setting)."""
    if not factor or not any(side % factor for side in config.size):
        return

    def nearest(side: int) -> int:
        low = side // factor * factor
        return max(factor, low if side - low <= low + factor - side else low + factor)

    given = config.resolution
    fits = nearest(given) if isinstance(given, int) else tuple(nearest(s) for s in given)
    sides = "a multiple" if isinstance(given, int) else "height and width multiples"
    raise error(f"{spell('resolution', given)} must be {sides} of {factor} ({why}); try {spell('resolution', fits)}")


def check_data_kind(config: TrainConfig, family: type[TrainModel] | None, source=None) -> None:
    """``DataError`` when the run's data (``source``, opened; or a ``data`` folder, by its file names) holds video
    clips and ``family`` trains on images, or the other way round."""
    if family is None:
        return
    if source is not None:
        clips = hasattr(source, "record_transform")  # a clip source's own transform (eqxdiff.data.ClipRecords)
    elif config.source == "folder" and Path(config.data).is_dir():
        clips = holds_videos(config.data)
    elif config.source in ("digits", "synthetic"):
        clips = False
    else:
        return  # a Hugging Face dataset or TFRecord files: known once opened
    what = {"folder": f"data={config.data!r}", "hf": f"hf_dataset={config.hf_dataset!r}"}.get(
        config.source, f"the {config.source} source")
    model = "the from-scratch digits architecture" if config.model is None else f"model={config.model!r}"
    if family.VIDEO and not clips:
        raise DataError(f"{model} trains {family.__name__} on video clips, but {what} holds images: give a folder "
                        f"of clips ({', '.join(VIDEO_EXTENSIONS)}) with captions and no images, or an hf_dataset "
                        "with a video column")
    if clips and not family.VIDEO:
        raise DataError(f"{what} holds video clips, but {model} trains {family.__name__} on images: give a folder of "
                        "images with captions (or a video model's folder)")
