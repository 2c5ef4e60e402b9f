"""What a run makes of what an earlier run left in its output folder, decided before anything is loaded: the
checkpoint it resumes from, once the settings saved with that checkpoint agree with its own (:func:`resume_point`),
and whether the autoencoder stage's VAE is reused (:func:`autoencoder_reuse`). Both read small JSON files only."""

import dataclasses
import json
import os
from pathlib import Path

from ._checkpoint import CheckpointMismatchError, saved_settings, saved_steps
from ._config import (
    TrainConfig,
    describe_changes,
    flat_settings,
    reported,
    resumable,
    run_settings,
    setting_changes,
    with_defaults,
)

# What the autoencoder stage's VAE depends on (dotted settings): its sizes, the stage's training and the data.
AUTOENCODER_SETTINGS = ("architecture.vae_channels", "architecture.latent_channels", "architecture.norm_num_groups",
                        "architecture.image_size", "autoencoder_steps", "autoencoder_batch_size",
                        "autoencoder_learning_rate", "kl_weight", "resolution", "data", "hf_dataset", "tfrecord")
AUTOENCODER_RECORD = "eqxdiff_autoencoder_stage.json"  # beside the saved VAE: the settings that trained it
_EXPORT = ("export_dir", "export_dtype", "export_scheduler", "lora.format")
_ELSEWHERE = "or output_dir=<another folder>"


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from: its ``step`` and ``folder``, the settings it was saved with (``None``: by
    eqxdiff before checkpoints held them) and the :data:`~eqxdiff.train._config.RESUMABLE` settings this run changes
    (``changes``: ``{name: (saved, now)}``)."""

    step: int
    folder: Path
    settings: dict | None
    changes: dict

    @property
    def note(self) -> str:
        """The changes, as one line (empty when there are none)."""
        if not self.changes:
            return ""
        return (f"resuming from {self.folder} with settings that may change on resume: "
                f"{describe_changes(self.changes)}")

    def finished(self, config: TrainConfig) -> bool:
        """Whether the checkpoint is at (or past) ``config.steps``, and the export it asks for is in place: written
        after this checkpoint, with the export settings it was saved with. Such a run has nothing to do."""
        if self.step < config.steps or any(k in self.changes for k in _EXPORT):
            return False
        done = config.export_file
        return done.is_file() and done.stat().st_mtime >= self.folder.stat().st_mtime


def resume_point(config: TrainConfig) -> ResumePoint | None:
    """The checkpoint :func:`eqxdiff.train.run` resumes from: the latest in ``OUTPUT_DIR/checkpoints`` (``None``
    when there is none, or with ``resume=False``), checked against the settings it was saved with. A setting that
    may change on resume (``steps``, logging, checkpoints, samples, the export, the mesh: the ``resume`` field's
    help) is listed in :attr:`ResumePoint.changes`; any other change raises
    :class:`~eqxdiff.train.CheckpointMismatchError` naming each ``name=saved -> now``. Nothing is loaded or written."""
    if not config.resume:
        return None
    directory = Path(config.output_dir) / "checkpoints"
    steps = saved_steps(directory)
    if not steps:
        return None
    step = steps[-1]
    folder = directory / str(step)
    saved = saved_settings(directory, step)
    if saved is None:  # the layout check (and config.json) stand in when the checkpoint is restored
        return ResumePoint(step, folder, None, {})
    changes = setting_changes(with_defaults(saved), run_settings(config))
    refused = {k: v for k, v in changes.items() if not resumable(k)}
    if refused:
        hint = ""
        if "optimizer.total_steps" in refused and config.optimizer.total_steps is None:
            hint = (f" (steps={config.steps} sets it unless it is given: optimizer.total_steps="
                    f"{refused['optimizer.total_steps'][0]} keeps the schedule)")
        raise CheckpointMismatchError(f"cannot resume from {folder}, trained with other settings: "
                                      f"{describe_changes(refused)}{hint}; give its settings to resume, "
                                      f"resume=False to start over (replacing its checkpoints), {_ELSEWHERE}")
    return ResumePoint(step, folder, saved, {k: v for k, v in changes.items() if reported(k)})


def autoencoder_reuse(config: TrainConfig) -> bool:
    """Whether the autoencoder stage of ``config`` (from scratch) reuses ``OUTPUT_DIR/autoencoder``: ``True`` when it
    holds a VAE trained with this run's :data:`AUTOENCODER_SETTINGS` (as recorded beside it; for a VAE saved by
    eqxdiff before it kept that record, as the run's ``config.json`` says), ``False`` when there is none. A VAE
    trained with other settings raises :class:`~eqxdiff.train.CheckpointMismatchError` naming them, before anything
    is written; with ``resume=False`` the stage trains a new one in its place (``False``)."""
    folder = Path(config.output_dir) / "autoencoder"
    if not (folder / "config.json").is_file():
        return False
    record = folder / AUTOENCODER_RECORD
    source = record if record.is_file() else Path(config.output_dir) / "config.json"
    try:
        saved = json.loads(source.read_text()) if source.is_file() else {}
    except json.JSONDecodeError:
        saved = {}
    saved = flat_settings(saved)  # (a record is flat; config.json nested)
    keys = tuple(k for k in AUTOENCODER_SETTINGS if k in saved)
    changes = setting_changes(saved, flat_settings(run_settings(config)), keys)
    if not changes:
        return True
    if not config.resume:
        return False
    raise CheckpointMismatchError(f"the autoencoder in {folder} was trained with other settings: "
                                  f"{describe_changes(changes)}; nothing was changed. Give its settings to reuse "
                                  f"it, resume=False to train a new one in its place, {_ELSEWHERE}")


def record_autoencoder(config: TrainConfig, folder: Path) -> None:
    """Write the :data:`AUTOENCODER_SETTINGS` of ``config`` beside the VAE saved in ``folder`` (whole or not at
    all: a temporary file renamed)."""
    settings = flat_settings(run_settings(config))
    record = {k: settings[k] for k in AUTOENCODER_SETTINGS}
    partial = folder / (AUTOENCODER_RECORD + ".partial")
    partial.write_text(json.dumps(record, indent=2))
    os.replace(partial, folder / AUTOENCODER_RECORD)
