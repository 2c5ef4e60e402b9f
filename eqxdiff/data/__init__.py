"""Data sources and input pipelines.

Sources (``len`` + ``[i]`` of raw image/caption records, checked when built): ``ImageFolderSource``,
``HFDatasetSource`` (``load_hf_dataset``: its dataset, loaded once), ``TFRecordSource``, ``SyntheticSource``;
``VideoFolderSource`` and ``HFVideoDatasetSource`` for clips (``FrameSampling``: count, stride, start;
``pixel_values`` ``[batch, frames, height, width, 3]``). ``make_dataset`` turns one into a
grain stream of ``{"pixel_values": float32 [batch, height, width, 3] in [-1, 1], "input_ids": int32 [batch,
seq]}`` whose iterator has ``get_state()``/``set_state()``; ``to_global_batch`` puts a host batch on a mesh
(sharded as ``eqxdiff.parallel.batch_sharding`` says).
"""

from ._arrays import ArrayBatches as ArrayBatches
from ._common import DataError as DataError
from ._folder import ImageFolderSource as ImageFolderSource
from ._hf import HFDatasetSource as HFDatasetSource
from ._hf import load_hf_dataset as load_hf_dataset
from ._hf_video import HFVideoDatasetSource as HFVideoDatasetSource
from ._hf_video import holds_clips as holds_clips
from ._pipeline import make_dataset as make_dataset
from ._pipeline import validate_decode as validate_decode
from ._sharding import to_global_batch as to_global_batch
from ._synthetic import SyntheticSource as SyntheticSource
from ._tfrecord import TFRecordSource as TFRecordSource
from ._tfrecord import write_tfrecord as write_tfrecord
from ._tokenizer import character_tokenizer as character_tokenizer
from ._transforms import IMAGE_FACTS as IMAGE_FACTS
from ._transforms import ImageCaptionTransform as ImageCaptionTransform
from ._video import VIDEO_EXTENSIONS as VIDEO_EXTENSIONS
from ._video import FrameSampling as FrameSampling
from ._video import VideoCaptionTransform as VideoCaptionTransform
from ._video import VideoFolderSource as VideoFolderSource
from ._video import holds_videos as holds_videos
from ._video import read_frames as read_frames
