"""The data a :class:`~eqxdiff.train.TrainConfig` selects: the digits in memory, or a source (image folder,
Hugging Face dataset, TFRecord files, synthetic images) checked before any model is built, streamed through
:func:`eqxdiff.data.make_dataset` with the run's resolution, crops, flips and seed."""

from pathlib import Path

from ..data import (
    HFDatasetSource,
    HFVideoDatasetSource,
    ImageFolderSource,
    SyntheticSource,
    TFRecordSource,
    VideoFolderSource,
    holds_clips,
    holds_videos,
    load_hf_dataset,
    make_dataset,
)
from ..data.digits import DigitsSource
from ._config import TrainConfig
from ._data import DataError, check_batch


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
        height, width = config.size
        source = SyntheticSource(max(1024, config.batch_size), height=height, width=width, seed=config.seed)
    elif source == "hf":  # loaded once: it says whether it holds clips, then the source reads it
        loaded = load_hf_dataset(config.hf_dataset, split=config.hf_split)
        if clips := holds_clips(loaded, column=config.image_column):  # sampled as config.frames says
            source = HFVideoDatasetSource(config.hf_dataset, split=config.hf_split, frames=config.frames,
                                          video_column=clips, dataset=loaded,
                                          **{k: v for k, v in columns.items() if k != "image_column"})
        else:
            source = HFDatasetSource(config.hf_dataset, split=config.hf_split, dataset=loaded, **columns)
    elif source == "tfrecord":
        keys = {k: v for k, v in (("image_key", config.image_key), ("caption_key", config.caption_key))
                if v is not None}
        source = TFRecordSource(config.tfrecord, **keys)
    elif Path(config.data).is_dir() and holds_videos(config.data):  # clips, sampled as config.frames says
        source = VideoFolderSource(config.data, frames=config.frames, **{
            {"image_column": "video_column"}.get(k, k): v for k, v in columns.items()})
    elif Path(config.data).is_dir():
        source = ImageFolderSource(config.data, **columns, caption=config.instance_prompt)
    else:
        name = config.data.lower()
        hint = ("; for TFRecord files use tfrecord" if ".tfrecord" in name else
                "; for a Hugging Face dataset (a Hub id, parquet, json, csv or arrow files) use hf_dataset")
        what = "is not 'digits', 'synthetic' or" if Path(config.data).exists() else "names no folder: give 'digits', " \
            "'synthetic' or"
        raise DataError(f"data={config.data!r} {what} a folder of images or clips with captions{hint}")
    if config.instance_prompt is not None and type(source) is not ImageFolderSource:  # it took the caption itself
        source = Prompted(source, config.instance_prompt)
    if len(source) < config.batch_size:
        raise DataError(f"{source!r} has {len(source)} samples, fewer than batch_size={config.batch_size}")
    return "source", source


def stream(config: TrainConfig, source, tokenizer, **kwargs):
    """:func:`eqxdiff.data.make_dataset` of ``source`` with the run's size (``(height, width)``), crops, flips and
    seed (``kwargs``: its other arguments: ``max_length``, ``image_keys``, ``shuffle`` ..., or another ``seed``)."""
    kwargs.setdefault("seed", config.seed)
    return make_dataset(source, tokenizer=_text_tokenizers(tokenizer), batch_size=config.batch_size,
                        resolution=config.size, center_crop=config.center_crop, random_flip=config.random_flip,
                        **kwargs)


class Prompted:
    """A source whose every record takes ``prompt`` as its caption (DreamBooth's instance prompt)."""

    def __init__(self, source, prompt: str):
        self.source, self.prompt = source, prompt
        if hasattr(source, "record_transform"):  # a clip source's records take its own transform, captioned or not
            self.record_transform = source.record_transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict:
        return {**self.source[index], "caption": self.prompt}

    def __repr__(self) -> str:
        return f"{self.source!r} captioned {self.prompt!r}"


def load_data(config: TrainConfig, tokenizer, *, image_keys: tuple[str, ...] = ()):
    """``("arrays", dict)`` for the digits (the whole set in memory: cacheable, exactly resumable) or
    ``("stream", grain dataset)`` for the other sources (:func:`eqxdiff.data.make_dataset`). Sources check their
    files when built, so bad data fails here, before any model is built or compiled. ``tokenizer``: one, or
    ``{batch key: tokenizer}`` for a model with several text encoders; ``image_keys``: the per-image facts the
    batches carry (a family's ``IMAGE_KEYS``: SDXL's original size and crop)."""
    kind, data = open_source(config, tokenizer)
    if kind == "arrays":
        return kind, data
    return "stream", stream(config, data, tokenizer, image_keys=image_keys)
