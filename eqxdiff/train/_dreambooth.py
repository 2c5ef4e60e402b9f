"""DreamBooth's prior preservation (diffusers' ``train_dreambooth*.py --with_prior_preservation``): class images the
model draws itself before training (:func:`class_images`), kept in a folder so that an interrupted run goes on where
it stopped and a later one reuses them, and batches pairing the data's rows with as many class rows
(:class:`PriorBatches`), weighted so the loss is the instance loss plus ``prior_loss_weight`` times the class loss.

Class image ``i`` is ``class_{i:05d}.png``, drawn in chunks of :data:`CHUNK` images from the key
``fold_in(key(seed), i // CHUNK)`` at the run's sampling recipe: the same image whether the folder was filled in one
run or several. ``class_images.json`` beside them records what drew them (prompt, model, size, recipe, seed); a
folder drawn otherwise is refused, naming the difference. Images already in the folder under other names (a user's
own class images) count towards ``num_class_images``.
"""

import dataclasses
import json
import os
import re
from pathlib import Path

import jax
import numpy as np

from ..data import ImageFolderSource
from ._config import TrainConfig, describe_changes, setting_changes
from ._metrics import log_line
from ._setup import sample_scheduler
from ._step import LOSS_WEIGHT

CHUNK = 4  # class images drawn per pipeline call (one compiled program, whatever the count)
RECORD = "class_images.json"
_NAME = re.compile(r"class_(\d{5})\.png")
_IMAGES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def class_folder(config: TrainConfig) -> Path:
    return Path(config.class_data_dir or Path(config.output_dir) / "class_images")


def class_record(config: TrainConfig, options) -> dict:
    """What draws the class images: the settings a reused folder must have been drawn with."""
    return json.loads(json.dumps({
        "class_prompt": config.class_prompt, "model": config.model, "resolution": config.resolution,
        "sample_steps": config.sample_steps, "sample_guidance_scale": config.sample_guidance_scale,
        "export_scheduler": config.export_scheduler, "seed": config.seed, "family": dataclasses.asdict(options)},
        default=str))


def _check_record(folder: Path, record: dict) -> None:
    file = folder / RECORD
    if not file.is_file():
        return
    saved = json.loads(file.read_text())
    changes = setting_changes(saved, record)
    if changes:
        raise ValueError(f"the class images in {folder} were drawn with other settings: {describe_changes(changes)}; "
                         f"give another class_data_dir, or delete its class_*.png and {RECORD} to draw them again")


def _save(image: np.ndarray, path: Path) -> None:
    """Write a PNG whole or not at all (a temporary file renamed): an interrupted run leaves no broken image."""
    from PIL import Image

    partial = path.with_name(path.name + ".partial")
    Image.fromarray(image).save(partial, format="PNG")
    os.replace(partial, path)


def class_images(config: TrainConfig, setup) -> ImageFolderSource:
    """The class images of ``config`` (``class_prompt`` for each), drawing the missing ones first with ``setup``'s
    model (its pipeline, the run's sampling recipe), as a source of the first ``num_class_images`` images of the
    folder."""
    folder = class_folder(config)
    folder.mkdir(parents=True, exist_ok=True)
    record = class_record(config, setup.model.options)
    images = sorted(p for p in folder.rglob("*") if p.suffix.lower() in _IMAGES and not p.name.startswith("."))
    own = {int(m.group(1)) for p in images if p.parent == folder and (m := _NAME.fullmatch(p.name))}
    if own:
        _check_record(folder, record)
    others = len(images) - len(own)
    wanted = range(max(config.num_class_images - others, 0))
    missing = [i for i in wanted if i not in own]
    if missing:
        if jax.process_index() == 0:
            (folder / RECORD).write_text(json.dumps(record, indent=2))
        log_line(f"class images: drawing {len(missing)} of {config.num_class_images} ({config.class_prompt!r}) "
                 f"into {folder}")
        pipe = setup.model.pipeline(setup.tokenizers, sample_scheduler(config, setup), options=setup.options)
        for chunk in sorted({i // CHUNK for i in missing}):
            drawn = np.asarray(pipe([config.class_prompt] * CHUNK, num_inference_steps=config.sample_steps,
                                    guidance_scale=config.sample_guidance_scale, height=config.size[0],
                                    width=config.size[1], key=jax.random.fold_in(jax.random.key(config.seed), chunk),
                                    progress=False, **setup.model.call_options()))
            for j, image in enumerate(drawn):
                i = chunk * CHUNK + j
                if i in missing and jax.process_index() == 0:
                    _save(image, folder / f"class_{i:05d}.png")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("eqxdiff class images")
    source = ImageFolderSource(folder, caption=config.class_prompt)
    return First(source, config.num_class_images)


class First:
    """The first ``n`` records of a source."""

    def __init__(self, source, n: int):
        self.source, self.n = source, min(n, len(source))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} records")
        return self.source[index]

    def __repr__(self) -> str:
        return f"the first {self.n} of {self.source!r}"


class PriorBatches:
    """Batches of the data's ``n`` rows then ``m`` class rows (as many, at one batch size), with per-sample
    ``loss_weight`` s ``(n + m) / n`` for the data's and ``prior_loss_weight (n + m) / m`` for the class images'
    (2 and ``2 prior_loss_weight``): the batch mean is then the instance loss plus ``prior_loss_weight`` times the
    class loss. Its state is both iterators' (exact resume)."""

    def __init__(self, instances, classes, prior_loss_weight: float):
        self.instances, self.classes, self.weight = instances, classes, float(prior_loss_weight)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        a, b = next(self.instances), next(self.classes)
        n, m = len(next(iter(a.values()))), len(next(iter(b.values())))
        batch = {k: np.concatenate([np.asarray(a[k]), np.asarray(b[k])]) for k in a}
        batch[LOSS_WEIGHT] = np.concatenate([np.full(n, (n + m) / n, np.float32),
                                             np.full(m, self.weight * (n + m) / m, np.float32)])
        return batch

    def get_state(self) -> dict:
        return {"instances": self.instances.get_state(), "classes": self.classes.get_state()}

    def set_state(self, state: dict) -> None:
        self.instances.set_state(state["instances"])
        self.classes.set_state(state["classes"])


__all__ = ["CHUNK", "First", "PriorBatches", "class_folder", "class_images"]
