"""Local image folders with captions, read the way diffusers' training scripts read them.

Either a ``metadata.jsonl`` (or ``metadata.csv``) in the folder, one row per image with ``file_name`` (a path
relative to the folder) and a caption column, or, without one, every image in the folder tree with a
``.txt`` caption beside it sharing its stem (``0001.png`` + ``0001.txt``). With ``caption=`` (DreamBooth's
instance or class prompt) every image of the folder tree takes that caption, and the folder needs none.
"""

import csv
import json
from pathlib import Path

from ._common import (
    IMAGE_EXTENSIONS,
    DataError,
    caption_problem,
    check_level,
    check_no_columns,
    files_below,
    image_problems,
    raise_problems,
    require_nonempty,
    with_txt_captions,
)


class ImageFolderSource:
    """Image + caption records from a local folder (``metadata.jsonl``/``metadata.csv``, or ``.txt`` files).

    Args:
        root: the folder.
        caption_column: the caption field of the metadata rows (diffusers' ``--caption_column``).
        image_column: the file-name field of the metadata rows.
        check: what is checked now, before training: ``"index"`` (every listed file exists and has a
            caption), ``"headers"`` (also opens every image header; the default), ``"full"`` (also decodes
            every image). Problems raise one ``DataError`` naming the files.
        caption: one caption for every image in the folder tree (no metadata or ``.txt`` files read).
    """

    def __init__(self, root, *, caption_column: str = "text", image_column: str = "file_name",
                 check: str = "headers", caption: str | None = None):
        check_level(check)
        self.root = Path(root)
        if not self.root.is_dir():
            raise DataError(f"image folder {self.root} does not exist or is not a folder")
        self.caption_column = caption_column
        self.image_column = image_column
        if caption is not None and (why := caption_problem(caption)):
            raise DataError(f"caption={caption!r}: {why}")
        metadata = [self.root / n for n in ("metadata.jsonl", "metadata.csv") if (self.root / n).is_file()]
        if caption is not None or not metadata:
            how = "one caption for every image" if caption is not None else "a .txt caption beside each image"
            check_no_columns(self.root, {"caption_column": caption_column, "image_column": image_column},
                             {"caption_column": "text", "image_column": "file_name"}, how)
        if caption is not None:
            self.index_file = None
            images = files_below(self.root, IMAGE_EXTENSIONS, f"no images with extensions {IMAGE_EXTENSIONS}")
            rows = [(image, caption) for image in images]
        elif metadata:
            self.index_file = metadata[0]
            rows = self._read_metadata(metadata[0])
        else:
            self.index_file = None
            how = f"no metadata.jsonl, metadata.csv or images with extensions {IMAGE_EXTENSIONS}"
            rows = with_txt_captions(files_below(self.root, IMAGE_EXTENSIONS, how), self.root)
        self.paths = [str(p) for p, _ in rows]
        self.captions = [c for _, c in rows]
        where = str(self.index_file or self.root)
        raise_problems(image_problems(self.paths, self.paths, check), where)

    def _read_metadata(self, path: Path):
        rows, problems = [], []
        if path.suffix == ".jsonl":
            records = []
            with open(path, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        records.append((line_no, json.loads(line)))
                    except json.JSONDecodeError as e:
                        problems.append(f"line {line_no}: not valid JSON ({e})")
        else:
            with open(path, encoding="utf-8", newline="") as f:
                records = [(i, row) for i, row in enumerate(csv.DictReader(f), 2)]
        for line_no, record in records:
            if not isinstance(record, dict) or self.image_column not in record:
                problems.append(f"line {line_no}: no {self.image_column!r} field")
                continue
            file = self.root / str(record[self.image_column])
            if self.caption_column not in record:
                keys = sorted(record)
                problems.append(f"{file}: missing caption (no {self.caption_column!r} field on line {line_no}; "
                                f"fields there: {keys}; set caption_column)")
                continue
            if why := caption_problem(record[self.caption_column]):
                problems.append(f"{file}: {why} (line {line_no})")
                continue
            if not file.is_file():
                problems.append(f"{file}: image file not found (line {line_no})")
                continue
            rows.append((file, record[self.caption_column]))
        raise_problems(problems, str(path))
        require_nonempty(len(rows), str(path), "no rows")
        return rows

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict:
        return {"image": self.paths[index], "caption": self.captions[index], "name": self.paths[index]}

    def __repr__(self) -> str:
        return f"ImageFolderSource({str(self.root)!r}, {len(self)} images)"
