"""What every layer above shares, with no dependency on any of them.

- the config base (:class:`ModelConfig`, :class:`ConfigError`) of models and schedulers;
- the run-time hooks models call (:class:`Plan`, :func:`constrain`, :func:`checkpoint_block`) and the logical-axis
  rules they read (:class:`AxisRules`, :data:`DEFAULT_RULES`);
- parameter naming (:func:`leaf_specs`: PyTorch names, layouts and logical axes), used by loading and parallel;
- the tree walk behind ``with_plan``, ``scan_layers`` and ``with_attention_implementation``;
- the family table (:data:`FAMILY_TABLE`): checkpoint class names to the eqxdiff classes serving them, and the
  families' single-file layouts (:data:`SINGLE_FILE_LAYOUTS`);
- the persistent compilation cache (:func:`enable_compilation_cache`), which the commands turn on, and
  :func:`program` (``eqx.filter_jit`` whose traced programs are kept there too: a later process skips tracing);
- transformers imported for its tokenizers without its framework notice (:func:`import_transformers`);
- imageio-ffmpeg as the video readers and writers use it (:func:`imageio_ffmpeg`, :data:`FFMPEG_AS_STORED`,
  :func:`ffmpeg_problem`), and GIFs read with Pillow instead (:func:`gif_frames`, :func:`gif_frame_count`).
"""

from ._cache import CacheWarning as CacheWarning
from ._cache import compilation_cache as compilation_cache
from ._cache import default_cache_dir as default_cache_dir
from ._cache import enable_compilation_cache as enable_compilation_cache
from ._cache import not_a_folder as not_a_folder
from ._cache import write_probe as write_probe
from ._config import ConfigError as ConfigError
from ._config import ModelConfig as ModelConfig
from ._families import FAMILY_TABLE as FAMILY_TABLE
from ._families import SINGLE_FILE_LAYOUTS as SINGLE_FILE_LAYOUTS
from ._families import family_names as family_names
from ._families import resolve_class as resolve_class
from ._families import single_file_layouts as single_file_layouts
from ._ffmpeg import AS_STORED as FFMPEG_AS_STORED
from ._ffmpeg import ffmpeg_problem as ffmpeg_problem
from ._ffmpeg import gif_frame_count as gif_frame_count
from ._ffmpeg import gif_frames as gif_frames
from ._ffmpeg import imageio_ffmpeg as imageio_ffmpeg
from ._naming import STACKED as STACKED
from ._naming import LeafSpec as LeafSpec
from ._naming import declared_axes as declared_axes
from ._naming import leaf_specs as leaf_specs
from ._naming import torch_shape as torch_shape
from ._plan import Plan as Plan
from ._plan import Remat as Remat
from ._plan import checkpoint_block as checkpoint_block
from ._plan import checkpoint_names as checkpoint_names
from ._plan import constrain as constrain
from ._plan import remat_policy as remat_policy
from ._plan import with_plan as with_plan
from ._programs import ProgramCacheWarning as ProgramCacheWarning
from ._programs import program as program
from ._rules import DEFAULT_RULES as DEFAULT_RULES
from ._rules import VIDEO_AXES as VIDEO_AXES
from ._rules import AxisRules as AxisRules
from ._rules import activation_sharding as activation_sharding
from ._rules import logical_to_spec as logical_to_spec
from ._transformers import import_transformers as import_transformers
from ._tree import has_field as has_field
from ._tree import map_modules as map_modules
from ._tree import module_classes as module_classes
from ._tree import replace_static as replace_static
