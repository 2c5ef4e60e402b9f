"""The grain pipeline: source -> shuffle -> this host's slice -> repeat -> decode/augment/tokenize -> batch.

Usage by a trainer (one process per host; ``batch_size`` is the global batch)::

    ds = make_dataset(ImageFolderSource("data/pokemon"), tokenizer=pipe.tokenizer, batch_size=32,
                      resolution=512, seed=0)
    it = iter(ds)                                  # a grain DatasetIterator
    for step in range(num_steps):
        batch = to_global_batch(next(it), mesh)    # {"pixel_values": [32, 512, 512, 3], "input_ids": [32, 77]}
        ...
        if step % save_every == 0:
            state = it.get_state()                 # a small JSON-able dict: the position of this host

    # resume: rebuild the same pipeline (same source, arguments and process count), then
    it = iter(make_dataset(...)); it.set_state(state)   # the next batch is the one that would have come next

With orbax, ``grain.checkpoint.CheckpointSave(it)`` / ``grain.checkpoint.CheckpointRestore(it)`` under an item
handled by ``grain.checkpoint.CheckpointHandler()`` save the same state, one JSON file per process.

Everything random (shuffle order per epoch, crops, flips, which of several captions) is a function of
``seed`` and the element's position, so the stream is reproducible and a restored iterator continues exactly.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import grain

from ._common import DataError, decode_image, raise_problems
from ._transforms import ImageCaptionTransform


def _host_shard(shard_options) -> tuple[int, int, bool]:
    if shard_options is None:
        shard_options = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    index, count = shard_options.shard_index, shard_options.shard_count
    if not 0 <= index < count:
        raise ValueError(f"shard_index={index} must be in [0, shard_count={count})")
    return index, count, shard_options.drop_remainder


def transform_for(source, images: ImageCaptionTransform):
    """The transform of ``source``'s records: ``images`` (tokenizers, size, crops, flips), or, for a source whose
    records are not images, what its ``record_transform(images)`` makes of it (``VideoFolderSource``: clips,
    ``pixel_values`` ``[frames, height, width, 3]``)."""
    make = getattr(source, "record_transform", None)
    return images if make is None else make(images)


def _read_ahead(transform, host_batch: int) -> grain.ReadOptions:
    """Reader threads and records read ahead: two batches of images (at least 8), one of clips (a clip record is
    its whole ``[frames, height, width, 3]`` float32: 81 frames at 720p are 0.9 GB)."""
    threads = min(16, os.cpu_count() or 1)
    if getattr(transform, "frames", None) is None:
        return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(2 * host_batch, 8))
    ahead = max(host_batch, 2)
    return grain.ReadOptions(num_threads=min(threads, ahead), prefetch_buffer_size=ahead)


def make_dataset(
    source,
    *,
    tokenizer,
    batch_size: int,
    resolution: int | tuple[int, int] = 512,
    center_crop: bool = True,
    random_flip: bool = True,
    interpolation: str = "bilinear",
    image_keys: tuple[str, ...] = (),
    max_length: int | dict[str, int] | None = None,
    clean_caption=None,
    shuffle: bool = True,
    seed: int = 0,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    shard_options: grain.sharding.ShardOptions | None = None,
    read_options: grain.ReadOptions | None = None,
    worker_count: int = 0,
) -> grain.IterDataset:
    """This host's stream of training batches ``{"pixel_values": float32 [b, height, width, 3] in [-1, 1],
    "input_ids": int32 [b, tokenizer.model_max_length]}``, with ``b = batch_size / shard_count``.

    Args:
        source: a source (``ImageFolderSource``, ``HFDatasetSource``, ``TFRecordSource``, ``SyntheticSource``,
            or any grain random-access source of raw records; clips: ``VideoFolderSource``, see :func:`transform_for`).
        tokenizer: the model's tokenizer (``transformers``); captions padded to its ``model_max_length``. A model
            with several text encoders gives ``{batch key: tokenizer}`` (``input_ids``, ``input_ids_2``).
        batch_size: the global batch size, over all hosts.
        resolution, center_crop, random_flip, interpolation: see ``ImageCaptionTransform``.
        image_keys: also yield these facts of each image, int32 ``[b, 2]`` (names of ``IMAGE_FACTS``: the
            ``original_size`` and ``crop_top_left`` a model conditions on; see ``ImageCaptionTransform``).
        max_length: token ids per caption (one number, or per key); default: each tokenizer's
            ``model_max_length``.
        clean_caption: a function applied to each caption before tokenizing (see ``ImageCaptionTransform``).
        shuffle: global shuffle, different each epoch. seed: seeds the shuffle and the augmentations.
        num_epochs: passes over the data; ``None`` repeats forever.
        drop_remainder: drop a last partial batch (with ``num_epochs``); keeps batch shapes static.
        shard_options: which slice this host reads; default ``grain.sharding.ShardByJaxProcess`` (slice
            ``jax.process_index()`` of ``jax.process_count()``, equal-length slices).
        read_options: grain's reader threads and prefetch; default a thread per core.
        worker_count: if > 0, decode in that many processes (``mp_prefetch``); the state stays exact.

    Returns:
        a ``grain.IterDataset``; ``iter()`` of it has ``get_state()``/``set_state()``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs={num_epochs} must be at least 1, or None to repeat forever")
    index, count, equal_shards = _host_shard(shard_options)
    if batch_size % count:
        raise ValueError(f"batch_size={batch_size} must be divisible by the number of hosts ({count})")
    host_batch = batch_size // count
    transform = transform_for(source, ImageCaptionTransform(tokenizer, resolution, center_crop, random_flip,
                                                            interpolation, image_keys, max_length, clean_caption))
    if len(source) == 0:
        raise DataError(f"empty dataset: {source!r} has no examples")

    ds = grain.MapDataset.source(source).seed(seed)
    if shuffle:
        ds = ds.shuffle()
    if equal_shards:  # every host gets the same number of examples, so no host waits for another at the end
        ds = ds[: len(ds) // count * count]
    ds = ds[index::count]
    if len(ds) == 0:
        raise DataError(f"empty dataset: host {index} of {count} gets no examples of {source!r}")
    if num_epochs is not None and drop_remainder and len(ds) * num_epochs < host_batch:
        raise DataError(f"{source!r} gives {len(ds) * num_epochs} examples to host {index} in {num_epochs} "
                        f"epoch(s), fewer than one batch of {host_batch}; with drop_remainder that is no batch")
    ds = ds.repeat(num_epochs).random_map(transform)
    it_ds = ds.to_iter_dataset(read_options or _read_ahead(transform, host_batch)).batch(host_batch, drop_remainder=drop_remainder)
    if worker_count > 0:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain <= 0.2.18 reads an absl flag in mp_prefetch (grain issue 1355)
            flags.FLAGS.mark_as_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return it_ds


def validate_decode(source, *, num_threads: int | None = None) -> None:
    """Decode every image of ``source`` now (a ``DataError`` listing the unreadable ones): the same as a source's
    ``check="full"``, for a source built with a lighter check."""
    def one(i):
        try:
            record = source[i]
            decode_image(record["image"], record["name"])
        except DataError as e:
            return str(e)
        return None

    with ThreadPoolExecutor(num_threads or os.cpu_count()) as pool:
        problems = [p for p in pool.map(one, range(len(source))) if p]
    raise_problems(problems, repr(source))

