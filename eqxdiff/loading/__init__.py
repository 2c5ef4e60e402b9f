"""Hugging Face checkpoints (safetensors + config.json) in and out of eqxdiff modules, and conversion rules for
other formats (:mod:`eqxdiff.loading._convert`'s vocabulary, known formats in :mod:`eqxdiff.loading.formats`)."""

from ._checkpoint import PACKAGED_MODELS as PACKAGED_MODELS
from ._checkpoint import CheckpointFiles as CheckpointFiles
from ._checkpoint import check_dtype as check_dtype
from ._checkpoint import key_map_rules as key_map_rules
from ._checkpoint import load as load
from ._checkpoint import model_class as model_class
from ._checkpoint import read_config as read_config
from ._checkpoint import read_json as read_json
from ._checkpoint import replacing_folder as replacing_folder
from ._checkpoint import resolve_folder as resolve_folder
from ._checkpoint import save_pretrained as save_pretrained
from ._checkpoint import weight_files as weight_files
from ._convert import Concat as Concat
from ._convert import Dim as Dim
from ._convert import Drop as Drop
from ._convert import Keep as Keep
from ._convert import LazyTensor as LazyTensor
from ._convert import Rename as Rename
from ._convert import Reshape as Reshape
from ._convert import Rule as Rule
from ._convert import Split as Split
from ._convert import Substitute as Substitute
from ._convert import SwapHalves as SwapHalves
from ._convert import TensorDict as TensorDict
from ._convert import Tie as Tie
from ._convert import Transpose as Transpose
from ._convert import convert as convert
from ._convert import convert_tensors as convert_tensors
from ._convert import inverse as inverse
from ._errors import CheckpointError as CheckpointError
from ._errors import ConversionError as ConversionError
from ._fill import fill_module as fill_module
from ._fill import state_dict as state_dict
from ._safetensors import SafetensorsFile as SafetensorsFile
from ._safetensors import write_safetensors as write_safetensors
