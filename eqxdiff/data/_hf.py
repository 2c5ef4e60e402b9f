"""Hugging Face ``datasets`` as a source: a saved dataset, parquet/json/csv files, an image folder, or a Hub id."""

import dataclasses
import os
from pathlib import Path

from ._common import DataError, caption_problem, check_level, image_problems, raise_problems, require_nonempty

_FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}


def _import_datasets():
    try:
        import datasets
    except ImportError as e:
        raise ImportError("HFDatasetSource needs the Hugging Face `datasets` package: "
                          "pip install 'eqxdiff[data]' (or pip install datasets)") from e
    return datasets


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _pick_split(ds, split: str, where: str):
    import datasets

    if isinstance(ds, (datasets.DatasetDict, dict)):
        if split not in ds:
            raise DataError(f"split {split!r} is not in {where}; its splits are {sorted(ds)}")
        return ds[split]
    return ds


def _where(path) -> str:
    """How messages name the dataset at ``path`` (a path or Hub id; a dataset object: ``the given dataset``)."""
    datasets = _import_datasets()
    return "the given dataset" if isinstance(path, (datasets.Dataset, datasets.DatasetDict)) else str(path)


def load_hf_dataset(path, *, split: str = "train", **load_kwargs):
    """The ``split`` of the Hugging Face dataset at ``path`` (what :class:`HFDatasetSource` reads; see its ``path``),
    loaded once: hand it to the source's ``dataset`` (and to :func:`~eqxdiff.data.holds_clips`) so that neither loads
    it again."""
    return _load(path, split, load_kwargs)[0]


def _load(path, split: str, load_kwargs: dict):
    datasets = _import_datasets()

    where = _where(path)
    if isinstance(path, (datasets.Dataset, datasets.DatasetDict)):
        return _pick_split(path, split, where), where
    local = Path(path)
    if local.is_dir() and any((local / n).is_file() for n in ("state.json", "dataset_dict.json")):
        return _pick_split(datasets.load_from_disk(where), split, where), where
    if local.is_file():
        builder = _FILE_BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise DataError(f"{where}: cannot read a dataset from a {local.suffix!r} file; use one of "
                            f"{sorted(_FILE_BUILDERS)}, a folder, or a dataset saved with save_to_disk")
        return datasets.load_dataset(builder, data_files=where, split=split, **load_kwargs), where
    if local.is_dir():  # an image folder, a folder of parquet files, a downloaded Hub repo: datasets infers it
        return datasets.load_dataset(where, split=split, **load_kwargs), where
    if os.path.isabs(where) or where.startswith((".", "~")) or where.count("/") > 1:
        raise DataError(f"dataset path {where} does not exist")
    try:
        return datasets.load_dataset(where, split=split, **load_kwargs), where
    except Exception as e:
        offline = " while offline (HF_HUB_OFFLINE is set)" if _hub_offline() else ""
        raise DataError(
            f"{where!r} is not a local path, and loading it as a Hugging Face Hub dataset failed{offline}: "
            f"{type(e).__name__}: {e}\nDownload it on a connected machine (`hf download {where} --repo-type "
            "dataset --local-dir DIR`) and pass DIR, or pass a saved dataset or parquet files."
        ) from e


class HFDatasetSource:
    """Image + caption records from a Hugging Face ``datasets`` dataset.

    Args:
        path: a ``datasets.Dataset``/``DatasetDict``; a folder written by ``save_to_disk``; a ``.parquet``,
            ``.json(l)``, ``.csv`` or ``.arrow`` file; a folder ``datasets`` can read (an image folder with
            ``metadata.jsonl``, parquet shards, a downloaded Hub repo); or a Hub id (needs the network,
            otherwise a ``DataError`` says how to get it).
        split: which split.
        image_column: column holding images (an ``Image`` feature, encoded bytes, or file paths).
        caption_column: column holding captions (strings or lists of strings).
        check: ``"index"`` (columns and captions), ``"headers"`` (also opens every image; default) or
            ``"full"`` (also decodes every image); problems raise one ``DataError`` naming the rows.
        dataset: the ``split`` of ``path`` already loaded (:func:`load_hf_dataset`), read instead of loading it
            again; ``path`` still names it and roots its relative file paths.
        **load_kwargs: passed to ``datasets.load_dataset`` (``data_files``, ``revision``, ``cache_dir``...).
    """

    def __init__(self, path, *, split: str = "train", image_column: str = "image", caption_column: str = "text",
                 check: str = "headers", dataset=None, **load_kwargs):
        datasets = _import_datasets()
        check_level(check)
        ds, self.where = _load(path, split, load_kwargs) if dataset is None else (dataset, _where(path))
        self.image_column, self.caption_column = image_column, caption_column
        for role, column in (("image_column", image_column), ("caption_column", caption_column)):
            if column not in ds.column_names:
                raise DataError(f"missing column: {role}={column!r} is not a column of {self.where}; "
                                f"its columns are {ds.column_names}")
        ds = ds.select_columns([image_column, caption_column])
        feature = ds.features[image_column]
        if isinstance(feature, (datasets.Image, datasets.Video)):  # decode in the pipeline, errors named there
            ds = ds.cast_column(image_column, dataclasses.replace(feature, decode=False))
        require_nonempty(len(ds), self.where, f"split {split!r} has 0 rows")
        self.dataset = ds
        self.base = Path(path) if isinstance(path, (str, os.PathLike)) and Path(path).is_dir() else None
        bad = [(i, why) for i, caption in enumerate(ds[caption_column]) if (why := caption_problem(caption))]
        problems = [f"{self._name(i, ds[i][image_column])}: {why}" for i, why in bad]
        raise_problems(problems, self.where)
        for start in range(0, len(ds) if check != "index" else 0, 1024):  # in chunks: images may be embedded
            images = list(ds[start : start + 1024][image_column])
            names = [self._name(start + i, image) for i, image in enumerate(images)]
            problems += self._media_problems([self._resolve(image) for image in images], names, check)
        raise_problems(problems, self.where)

    record_key = "image"
    """The key of a record's image (a subclass's media: ``video``)."""

    def _media_problems(self, images: list, names: list[str], check: str) -> list[str]:
        return image_problems(images, names, check)

    def _resolve(self, image):
        if isinstance(image, str) and self.base is not None and not os.path.isabs(image):
            return str(self.base / image)
        return image

    def _name(self, index: int, image) -> str:
        path = image.get("path") if isinstance(image, dict) else image if isinstance(image, str) else None
        return f"{self.where} row {index}" + (f" ({path})" if path else "")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        row = self.dataset[index]
        image = row[self.image_column]
        return {self.record_key: self._resolve(image), "caption": row[self.caption_column],
                "name": self._name(index, image)}

    def __repr__(self) -> str:
        return f"HFDatasetSource({self.where!r}, {len(self)} rows)"
