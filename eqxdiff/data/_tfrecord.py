"""TFRecord files of ``tf.train.Example`` records, read without TensorFlow.

The container is framed as ``uint64 length, uint32 masked crc32c(length), data, uint32 masked crc32c(data)``
(grain ships a reader of the same framing, ``grain.experimental.TFRecordIterDataset``, but only as a sequential
iterator). Here one pass over the frame headers builds an index of record offsets, so TFRecords get the same
random access, global shuffle, host sharding and exact iterator state as every other source. Records are
parsed with ``protobuf`` against the ``tf.train.Example`` schema declared below (the field numbers of
TensorFlow's ``example.proto``/``feature.proto``). CRCs are checked by the writer, not by the reader.
"""

import functools
import struct
from pathlib import Path

from ._common import DataError, caption_problem, check_level, image_problem, raise_problems, require_nonempty

_HEADER = struct.Struct("<QI")


@functools.cache
def example_class():
    """The ``tf.train.Example`` message class, built from a descriptor (no TensorFlow, no generated code)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="eqxdiff/tf_example.proto", package="tensorflow", syntax="proto3")

    def message(name, fields):
        m = fd.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
        return m

    rep, opt = field.LABEL_REPEATED, field.LABEL_OPTIONAL
    message("BytesList", [("value", 1, field.TYPE_BYTES, rep, None)])
    message("FloatList", [("value", 1, field.TYPE_FLOAT, rep, None)]).field[0].options.packed = True
    message("Int64List", [("value", 1, field.TYPE_INT64, rep, None)]).field[0].options.packed = True
    feature = message("Feature", [("bytes_list", 1, field.TYPE_MESSAGE, opt, ".tensorflow.BytesList"),
                                  ("float_list", 2, field.TYPE_MESSAGE, opt, ".tensorflow.FloatList"),
                                  ("int64_list", 3, field.TYPE_MESSAGE, opt, ".tensorflow.Int64List")])
    feature.oneof_decl.add(name="kind")
    for f in feature.field:
        f.oneof_index = 0
    features = message("Features", [("feature", 1, field.TYPE_MESSAGE, rep, ".tensorflow.Features.FeatureEntry")])
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=field.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=field.TYPE_MESSAGE, label=opt, type_name=".tensorflow.Feature")
    message("Example", [("features", 1, field.TYPE_MESSAGE, opt, ".tensorflow.Features")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


@functools.cache
def _crc_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


def _masked_crc(data: bytes) -> int:
    table, crc = _crc_table(), 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def write_tfrecord(path, records, *, image_key: str = "image", caption_key: str = "text") -> None:
    """Write ``(encoded_image_bytes, caption)`` pairs as ``tf.train.Example`` records TensorFlow can read
    (CRCs included). A pure-Python CRC: fine for converting a small set or for tests, slow for terabytes."""
    example = example_class()
    with open(path, "wb") as f:
        for image, caption in records:
            ex = example()
            ex.features.feature[image_key].bytes_list.value.append(bytes(image))
            captions = [caption] if isinstance(caption, str) else list(caption)
            ex.features.feature[caption_key].bytes_list.value.extend(c.encode("utf-8") for c in captions)
            data = ex.SerializeToString()
            length = struct.pack("<Q", len(data))
            f.write(length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data)))


def _index(path: Path) -> list[int]:
    """Byte offsets of every record's data in ``path``; a truncated or mis-framed file is a ``DataError``."""
    offsets, size = [], path.stat().st_size
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                raise DataError(f"{path}: not a TFRecord file or truncated (a partial record header at byte {pos})")
            (length, _), start = _HEADER.unpack(header), pos + _HEADER.size
            pos = start + length + 4
            if pos > size:
                raise DataError(f"{path}: not a TFRecord file or truncated (record at byte {start - _HEADER.size} "
                                f"claims {length} bytes, the file ends at {size})")
            offsets.append(start)
            f.seek(pos)
    return offsets


class TFRecordSource:
    """Image + caption records from TFRecord files of ``tf.train.Example`` (no TensorFlow needed).

    Args:
        paths: one file or folder, or a list of them (a folder means its ``*.tfrecord*`` files, sorted).
        image_key: the bytes feature holding the encoded image (PNG, JPEG, ...).
        caption_key: the bytes feature holding the caption (several values: one is drawn per use).
        check: ``"index"`` (record framing only, reads headers), ``"headers"`` (also parses every record,
            checks both keys and opens every image; default) or ``"full"`` (also decodes every image).
    """

    def __init__(self, paths, *, image_key: str = "image", caption_key: str = "text", check: str = "headers"):
        check_level(check)
        self.image_key, self.caption_key = image_key, caption_key
        files = []
        for p in [paths] if isinstance(paths, (str, Path)) else list(paths):
            p = Path(p)
            if p.is_dir():
                files.extend(sorted(f for f in p.iterdir() if ".tfrecord" in f.name and f.is_file()))
            elif p.is_file():
                files.append(p)
            else:
                raise DataError(f"TFRecord path {p} does not exist")
        self.where = str(paths if isinstance(paths, (str, Path)) else [str(p) for p in paths])
        require_nonempty(len(files), self.where, "no .tfrecord files")
        self.records = [(str(f), offset) for f in files for offset in _index(f)]
        require_nonempty(len(self.records), self.where, "the files hold no records")
        if check != "index":
            problems = []
            for i in range(len(self)):
                try:
                    record = self[i]
                except DataError as e:
                    problems.append(str(e))
                    continue
                if why := image_problem(record["image"], record["name"], check):
                    problems.append(why)
            raise_problems(problems, self.where)

    def __len__(self) -> int:
        return len(self.records)

    def _read(self, index: int):
        file, offset = self.records[index]
        with open(file, "rb") as f:
            f.seek(offset - _HEADER.size)
            (length, _) = _HEADER.unpack(f.read(_HEADER.size))
            data = f.read(length)
        try:
            return example_class().FromString(data).features.feature
        except Exception as e:
            raise DataError(f"{file} record at byte {offset - _HEADER.size}: not a tf.train.Example ({e})") from e

    def __getitem__(self, index: int) -> dict:
        file, offset = self.records[index]
        name = f"{file} record {index} (byte {offset - _HEADER.size})"
        features = self._read(index)
        values = {}
        for role, key in (("image_key", self.image_key), ("caption_key", self.caption_key)):
            if key not in features or features[key].WhichOneof("kind") != "bytes_list":
                raise DataError(f"{name}: missing {'caption' if role == 'caption_key' else 'image'}: no bytes "
                                f"feature {role}={key!r}; its features are {sorted(features)}")
            values[role] = list(features[key].bytes_list.value)
        if not values["image_key"]:
            raise DataError(f"{name}: the image feature {self.image_key!r} is empty")
        try:
            captions = [c.decode("utf-8") for c in values["caption_key"]]
        except UnicodeDecodeError as e:
            raise DataError(f"{name}: caption is not UTF-8 ({e})") from e
        caption = captions[0] if len(captions) == 1 else captions
        if why := caption_problem(caption):
            raise DataError(f"{name}: {why}")
        return {"image": values["image_key"][0], "caption": caption, "name": name}

    def __repr__(self) -> str:
        return f"TFRecordSource({self.where!r}, {len(self)} records)"
