"""eqxdiff.data: every source gives correctly shaped, correctly captioned, correctly sharded batches; augmentations
are reproducible by seed; the iterator state restores exactly; bad data raises before training, naming the file."""

import json

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from PIL import Image

from eqxdiff.data import (
    DataError,
    HFDatasetSource,
    ImageFolderSource,
    SyntheticSource,
    TFRecordSource,
    character_tokenizer,
    make_dataset,
    to_global_batch,
    validate_decode,
    write_tfrecord,
)
from eqxdiff.parallel import batch_sharding

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255),
          "black": (0, 0, 0), "yellow": (255, 255, 0)}
SIZES = [(40, 30), (30, 50), (32, 32), (64, 48), (24, 60), (33, 35)]  # (width, height): every aspect ratio


@pytest.fixture(scope="module")
def tokenizer():
    return character_tokenizer(16)


def _png(path, color, size):
    Image.new("RGB", size, color).save(path)
    return path


def _colored_folder(root, *, metadata=True, caption_column="text"):
    """One solid-colour image per colour, captioned with the colour's name: captions and pixels can be checked
    against each other after any shuffle."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for (name, rgb), size in zip(COLORS.items(), SIZES):
        _png(root / f"{name}.png", rgb, size)
        rows.append({"file_name": f"{name}.png", caption_column: f"a {name} square"})
        if not metadata:
            (root / f"{name}.txt").write_text(f"a {name} square\n")
    if metadata:
        (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _captions(tokenizer, input_ids):
    return [s.replace(" ", "") for s in tokenizer.batch_decode(input_ids, skip_special_tokens=True)]


def _check_colored_batch(batch, tokenizer, batch_size, resolution=16):
    px, ids = batch["pixel_values"], batch["input_ids"]
    assert px.shape == (batch_size, resolution, resolution, 3) and px.dtype == np.float32
    assert ids.shape == (batch_size, 16) and ids.dtype == np.int32
    assert px.min() >= -1 and px.max() <= 1
    for image, caption in zip(px, _captions(tokenizer, ids)):
        name = caption[1:-6]  # "a{name}square"
        assert name in COLORS, caption
        np.testing.assert_allclose(image, np.broadcast_to(np.array(COLORS[name]) / 127.5 - 1, image.shape),
                                   atol=1e-6)


def _take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def _assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


# ---------------------------------------------------------------- sources


@pytest.mark.parametrize("metadata", [True, False], ids=["metadata.jsonl", "txt-per-image"])
def test_image_folder(tmp_path, tokenizer, metadata):
    source = ImageFolderSource(_colored_folder(tmp_path / "imgs", metadata=metadata))
    assert len(source) == len(COLORS)
    for batch in _take(make_dataset(source, tokenizer=tokenizer, batch_size=4, resolution=16, seed=1), 3):
        _check_colored_batch(batch, tokenizer, 4)


def test_image_folder_caption_column_and_ids(tmp_path, tokenizer):
    source = ImageFolderSource(_colored_folder(tmp_path / "imgs", caption_column="prompt"), caption_column="prompt")
    (batch,) = _take(make_dataset(source, tokenizer=tokenizer, batch_size=6, resolution=16, shuffle=False), 1)
    expected = tokenizer([f"a {c} square" for c in COLORS], padding="max_length", max_length=16,
                         truncation=True, return_tensors="np")["input_ids"]
    np.testing.assert_array_equal(batch["input_ids"], expected)
    assert batch["input_ids"][0, 0] == tokenizer.bos_token_id and batch["input_ids"][0, -1] == tokenizer.pad_token_id


def test_hf_saved_parquet_and_imagefolder(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    folder = _colored_folder(tmp_path / "imgs")
    ds = datasets.Dataset.from_dict({
        "img": [str(folder / f"{c}.png") for c in COLORS],
        "caption": [f"a {c} square" for c in COLORS],
        "other": list(range(len(COLORS))),
    }).cast_column("img", datasets.Image())
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "data.parquet"))
    cache = str(tmp_path / "cache")
    sources = [
        HFDatasetSource(str(tmp_path / "saved"), image_column="img", caption_column="caption"),
        HFDatasetSource(str(tmp_path / "data.parquet"), image_column="img", caption_column="caption",
                        cache_dir=cache),
        HFDatasetSource(str(folder), cache_dir=cache),  # datasets' imagefolder reads metadata.jsonl itself
        HFDatasetSource(ds, image_column="img", caption_column="caption"),
    ]
    for source in sources:
        assert len(source) == len(COLORS)
        for batch in _take(make_dataset(source, tokenizer=tokenizer, batch_size=3, resolution=16), 2):
            _check_colored_batch(batch, tokenizer, 3)


def test_tfrecord(tmp_path, tokenizer):
    folder = _colored_folder(tmp_path / "imgs")
    colors = list(COLORS)
    write_tfrecord(tmp_path / "a.tfrecord", [((folder / f"{c}.png").read_bytes(), f"a {c} square") for c in colors[:4]])
    write_tfrecord(tmp_path / "b.tfrecord", [((folder / f"{c}.png").read_bytes(), f"a {c} square") for c in colors[4:]])
    source = TFRecordSource(tmp_path)
    assert len(source) == len(COLORS)
    for batch in _take(make_dataset(source, tokenizer=tokenizer, batch_size=4, resolution=16, seed=3), 3):
        _check_colored_batch(batch, tokenizer, 4)


def test_tfrecord_framing_matches_grain_reader(tmp_path):
    """grain's own (sequential) TFRecord reader sees the same records as our index."""
    write_tfrecord(tmp_path / "x.tfrecord", [(b"\x89PNG-not-really", "a caption"), (b"xyz", ["one", "two"])])
    raw = list(grain.experimental.TFRecordIterDataset(str(tmp_path / "x.tfrecord")))
    source = TFRecordSource(tmp_path / "x.tfrecord", check="index")
    assert len(raw) == len(source) == 2
    assert source[0]["image"] == b"\x89PNG-not-really" and source[0]["caption"] == "a caption"
    assert source[1]["caption"] == ["one", "two"]


def test_synthetic_deterministic(tokenizer):
    a, b, c = SyntheticSource(8, seed=0), SyntheticSource(8, seed=0), SyntheticSource(8, seed=1)
    np.testing.assert_array_equal(a[3]["image"], b[3]["image"])
    assert a[3]["caption"] == b[3]["caption"]
    assert not np.array_equal(a[3]["image"], c[3]["image"])
    (batch,) = _take(make_dataset(a, tokenizer=tokenizer, batch_size=8, resolution=64, random_flip=False,
                                  shuffle=False), 1)
    np.testing.assert_allclose(batch["pixel_values"][3], a[3]["image"] / 127.5 - 1, atol=1e-6)


# ---------------------------------------------------------------- transforms


def test_resize_shorter_side_then_center_crop(tmp_path, tokenizer):
    # 64 wide x 32 high, original columns 0..39 black, the rest white. The shorter side 32 -> 16 makes it
    # 32 x 16 (nearest: column j samples 2j + 1, so columns 0..19 black); the center crop starts at column 8,
    # so crop columns 0..11 are black and 12..15 white.
    image = np.full((32, 64, 3), 255, np.uint8)
    image[:, :40] = 0
    Image.fromarray(image).save(tmp_path / "img.png")
    (tmp_path / "img.txt").write_text("a b")
    ds = make_dataset(ImageFolderSource(tmp_path), tokenizer=tokenizer, batch_size=1, resolution=16,
                      random_flip=False, interpolation="nearest")
    px = _take(ds, 1)[0]["pixel_values"][0]
    assert px.shape == (16, 16, 3)
    np.testing.assert_array_equal(px, np.where(np.arange(16) < 12, -1.0, 1.0)[None, :, None].repeat(16, 0).repeat(3, 2))


def _gradient_source(tmp_path, n=16, width=32):
    ramp = np.tile(np.linspace(0, 255, width).astype(np.uint8)[None, :, None], (32, 1, 3))  # brighter rightwards
    for i in range(n):
        Image.fromarray(ramp).save(tmp_path / f"{i:02d}.png")
        (tmp_path / f"{i:02d}.txt").write_text("ramp")
    return ImageFolderSource(tmp_path)


def test_flip_reproducible_by_seed(tmp_path, tokenizer):
    source = _gradient_source(tmp_path)

    def flips(seed):
        (batch,) = _take(make_dataset(source, tokenizer=tokenizer, batch_size=16, resolution=32, seed=seed), 1)
        px = batch["pixel_values"][:, 0, :, 0]
        increasing, decreasing = np.all(np.diff(px) > 0, axis=1), np.all(np.diff(px) < 0, axis=1)
        assert np.all(increasing | decreasing)  # each image is the ramp or its exact mirror
        return decreasing

    a, b, c = flips(0), flips(0), flips(1)
    np.testing.assert_array_equal(a, b)
    assert 0 < a.sum() < 16 and not np.array_equal(a, c)  # P(equal by chance) = 2**-16


def test_random_crop_reproducible(tmp_path, tokenizer):
    source = _gradient_source(tmp_path, width=128)  # 32 x 128 -> resized to 16 x 64: crops can move 48 pixels
    kwargs = dict(tokenizer=tokenizer, batch_size=16, resolution=16, center_crop=False, random_flip=False)
    (a,), (b,) = _take(make_dataset(source, seed=5, **kwargs), 1), _take(make_dataset(source, seed=5, **kwargs), 1)
    np.testing.assert_array_equal(a["pixel_values"], b["pixel_values"])
    lefts = a["pixel_values"][:, 0, 0, 0]
    assert len(np.unique(lefts)) > 1  # the crops moved


# ---------------------------------------------------------------- state and sharding


def test_iterator_state_restores_exactly(tmp_path, tokenizer):
    source = SyntheticSource(10, height=20, width=24)  # 10 examples, batch 4: batches cross epoch boundaries
    kwargs = dict(tokenizer=tokenizer, batch_size=4, resolution=16, seed=7)
    it = iter(make_dataset(source, **kwargs))
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(4)]
    restored = iter(make_dataset(source, **kwargs))
    restored.set_state(state)
    _assert_same_batches([next(restored) for _ in range(4)], expected)
    # grain's orbax handler writes the same state as a JSON file per process
    it2 = iter(make_dataset(source, **kwargs))
    for _ in range(3):
        next(it2)
    grain.checkpoint.CheckpointHandler().save(tmp_path, item=it2)
    restored2 = grain.checkpoint.CheckpointHandler().restore(tmp_path, item=iter(make_dataset(source, **kwargs)))
    _assert_same_batches([next(restored2) for _ in range(4)], expected)


class _Indexed:
    """Records whose caption spells their index, so a batch says which examples it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        word = "".join("abcdefghij"[int(d)] for d in str(i))
        return {"image": np.zeros((8, 8, 3), np.uint8), "caption": word, "name": f"example {i}"}


def test_host_shards_disjoint_and_complete(tokenizer):
    source, count = _Indexed(21), 3
    seen = []
    for index in range(count):
        ds = make_dataset(source, tokenizer=tokenizer, batch_size=6, resolution=8, seed=2, num_epochs=1,
                          shard_options=grain.sharding.ShardOptions(index, count, drop_remainder=True))
        batches = list(ds)
        assert len(batches) == 3 and all(b["input_ids"].shape == (2, 16) for b in batches)
        seen.append({c for b in batches for c in _captions(tokenizer, b["input_ids"])})
    assert all(not (seen[i] & seen[j]) for i in range(count) for j in range(i + 1, count))
    assert len(set().union(*seen)) == 18  # 21 // 3 * 3: equal slices, so no host waits on another


def test_global_batch_sharded_over_data_and_fsdp(tokenizer):
    assert jax.device_count() == 8, "tests/conftest.py should give 8 simulated CPU devices"
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    (host,) = _take(make_dataset(SyntheticSource(16, height=8, width=8), tokenizer=tokenizer, batch_size=8,
                                 resolution=8), 1)
    batch = to_global_batch(host, mesh)
    for name in ("pixel_values", "input_ids"):
        array = batch[name]
        assert array.shape == host[name].shape and array.dtype == host[name].dtype
        assert isinstance(array.sharding, NamedSharding)
        assert array.sharding.spec == PartitionSpec(("data", "fsdp"))
        assert len(array.addressable_shards) == 8
        for shard in array.addressable_shards:
            assert shard.data.shape[0] == 2  # 8 examples over data x fsdp = 4 shards, replicated over tensor
            np.testing.assert_array_equal(np.asarray(shard.data), host[name][shard.index])
        np.testing.assert_array_equal(np.asarray(array), host[name])
    # a given sharding is used as is; a mesh without fsdp splits over data alone, one without batch axes replicates
    data_only = Mesh(np.array(jax.devices()), ("data",))
    assert batch_sharding(data_only, (8, 2)).spec == PartitionSpec("data")
    assert to_global_batch({"x": np.zeros((8, 2))}, data_only)["x"].sharding.spec == PartitionSpec("data")
    replicated = NamedSharding(mesh, PartitionSpec())
    assert to_global_batch(host, replicated)["input_ids"].sharding.is_fully_replicated
    tensor_only = Mesh(np.array(jax.devices()), ("tensor",))
    assert to_global_batch({"x": np.zeros((3, 2))}, tensor_only)["x"].sharding.is_fully_replicated
    with pytest.raises(DataError, match="not divisible by the 8 batch shards"):
        to_global_batch({"x": np.zeros((6, 2))}, data_only)
    with pytest.raises(DataError, match="not divisible by the 4 batch shards"):
        to_global_batch({"x": np.zeros((6, 2))}, mesh)


# ---------------------------------------------------------------- errors


def test_folder_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        ImageFolderSource(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty dataset"):
        ImageFolderSource(tmp_path / "empty")
    # .txt captions: one image has no caption
    txt = _colored_folder(tmp_path / "txt", metadata=False)
    (txt / "blue.txt").unlink()
    with pytest.raises(DataError, match=r"blue\.png: missing caption"):
        ImageFolderSource(txt)
    # metadata: a row without the caption column, a listed file that is missing, an empty metadata file
    meta = _colored_folder(tmp_path / "meta")
    rows = [json.loads(line) for line in (meta / "metadata.jsonl").read_text().splitlines()]
    del rows[1]["text"]
    rows.append({"file_name": "ghost.png", "text": "boo"})
    (meta / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"(?s)2 problem.*green\.png: missing caption.*ghost\.png: image file not found"):
        ImageFolderSource(meta)
    with pytest.raises(DataError, match=r"no 'prompt' field"):
        ImageFolderSource(_colored_folder(tmp_path / "meta2"), caption_column="prompt")
    with pytest.raises(DataError, match=r"line 1: no 'image' field"):
        ImageFolderSource(tmp_path / "meta2", image_column="image")
    (meta / "metadata.jsonl").write_text("")
    with pytest.raises(DataError, match="empty dataset"):
        ImageFolderSource(meta)


def test_unreadable_images(tmp_path, tokenizer):
    folder = _colored_folder(tmp_path / "imgs")
    (folder / "red.png").write_bytes(b"this is not a png")
    with pytest.raises(DataError, match=r"unreadable image .*red\.png"):
        ImageFolderSource(folder)
    # a truncated PNG: the header reads, decoding fails; "full" finds it before training...
    good = (folder / "green.png").read_bytes()
    _png(folder / "red.png", COLORS["red"], (64, 64))
    big = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    big.save(folder / "red.png")
    (folder / "red.png").write_bytes((folder / "red.png").read_bytes()[:400])
    assert good  # the other images are intact
    source = ImageFolderSource(folder)  # headers only: passes
    with pytest.raises(DataError, match=r"unreadable image .*red\.png"):
        ImageFolderSource(folder, check="full")
    with pytest.raises(DataError, match=r"unreadable image .*red\.png"):
        validate_decode(source)
    # ...and with a light check the pipeline still names the file when it meets it
    with pytest.raises(DataError, match=r"unreadable image .*red\.png"):
        list(make_dataset(source, tokenizer=tokenizer, batch_size=6, resolution=16, num_epochs=1, shuffle=False))
    with pytest.raises(ValueError, match="check='everything'"):
        ImageFolderSource(folder, check="everything")


def test_hf_errors(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = _colored_folder(tmp_path / "imgs")
    ds = datasets.Dataset.from_dict({"image": [str(folder / "red.png"), str(folder / "blue.png")],
                                     "text": ["a red square", None]}).cast_column("image", datasets.Image())
    with pytest.raises(DataError, match=r"missing column: caption_column='caption'.*\['image', 'text'\]"):
        HFDatasetSource(ds, caption_column="caption")
    with pytest.raises(DataError, match=r"row 1 \(.*blue\.png\): missing caption"):
        HFDatasetSource(ds)
    with pytest.raises(DataError, match="empty dataset"):
        HFDatasetSource(ds.select([]))
    (folder / "red.png").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"row 0 \(.*red\.png\)"):
        HFDatasetSource(ds.select([0]))
    with pytest.raises(DataError, match=r"split 'validation' is not in .*\['train'\]"):
        HFDatasetSource(datasets.DatasetDict({"train": ds}), split="validation")
    with pytest.raises(DataError, match="does not exist"):
        HFDatasetSource(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(DataError, match=r"(?s)not a local path.*HF_HUB_OFFLINE.*hf download"):
        HFDatasetSource("nobody-eqxdiff/no-such-dataset", cache_dir=str(tmp_path / "cache"))


def test_tfrecord_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        TFRecordSource(tmp_path / "missing.tfrecord")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty dataset"):
        TFRecordSource(tmp_path / "empty")
    write_tfrecord(tmp_path / "ok.tfrecord", [(b"not an image", "caption")])
    data = (tmp_path / "ok.tfrecord").read_bytes()
    (tmp_path / "cut.tfrecord").write_bytes(data[:-5])
    with pytest.raises(DataError, match=r"cut\.tfrecord: not a TFRecord file or truncated"):
        TFRecordSource(tmp_path / "cut.tfrecord")
    with pytest.raises(DataError, match=r"unreadable image .*ok\.tfrecord record 0"):
        TFRecordSource(tmp_path / "ok.tfrecord")
    with pytest.raises(DataError, match=r"ok\.tfrecord record 0.*missing caption.*caption_key='prompt'.*\['image', 'text'\]"):
        TFRecordSource(tmp_path / "ok.tfrecord", caption_key="prompt")


def test_pipeline_errors(tokenizer):
    source = SyntheticSource(4, height=8, width=8)
    with pytest.raises(ValueError, match="divisible by the number of hosts"):
        make_dataset(source, tokenizer=tokenizer, batch_size=3, resolution=8,
                     shard_options=grain.sharding.ShardOptions(0, 2))
    with pytest.raises(DataError, match="fewer than one batch"):
        make_dataset(source, tokenizer=tokenizer, batch_size=8, resolution=8, num_epochs=1)
    with pytest.raises(ValueError, match="interpolation='cubic'"):
        make_dataset(source, tokenizer=tokenizer, batch_size=2, resolution=8, interpolation="cubic")
    with pytest.raises(ValueError, match=r"image_keys \['aspect_ratio'\] are not facts the transform records; ask "
                       r"for some of \['original_size', 'crop_top_left'\]"):
        make_dataset(source, tokenizer=tokenizer, batch_size=2, resolution=8, image_keys=("crop_top_left",
                                                                                          "aspect_ratio"))


def test_image_facts_are_what_the_model_asks_for(tokenizer):
    """A stream carries the per-image facts asked for by name (``image_keys``, a model's ``IMAGE_KEYS``), only
    those: none by default, one alone, or both, as int32 pairs per image."""
    source = SyntheticSource(4, height=20, width=10)
    kwargs = dict(tokenizer=tokenizer, batch_size=4, resolution=8, shuffle=False, random_flip=False)
    (plain,) = _take(make_dataset(source, **kwargs), 1)
    assert sorted(plain) == ["input_ids", "pixel_values"]
    (crop,) = _take(make_dataset(source, image_keys=("crop_top_left",), **kwargs), 1)
    assert sorted(crop) == ["crop_top_left", "input_ids", "pixel_values"]
    (both,) = _take(make_dataset(source, image_keys=("original_size", "crop_top_left"), **kwargs), 1)
    assert both["original_size"].dtype == np.int32 and both["original_size"].tolist() == [[20, 10]] * 4
    assert both["crop_top_left"].tolist() == crop["crop_top_left"].tolist() == [[4, 0]] * 4  # 16 x 8, centered
    np.testing.assert_array_equal(both["pixel_values"], plain["pixel_values"])


def test_worker_processes_same_batches_and_state(tokenizer):
    source = SyntheticSource(12, height=10, width=12)
    kwargs = dict(tokenizer=tokenizer, batch_size=4, resolution=8, seed=4)
    expected = _take(make_dataset(source, **kwargs), 4)
    it = iter(make_dataset(source, worker_count=1, **kwargs))
    _assert_same_batches([next(it) for _ in range(2)], expected[:2])
    state = it.get_state()
    restored = iter(make_dataset(source, worker_count=1, **kwargs))
    restored.set_state(state)
    _assert_same_batches([next(restored) for _ in range(2)], expected[2:])
