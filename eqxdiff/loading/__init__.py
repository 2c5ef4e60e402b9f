"""Hugging Face checkpoints (safetensors + config.json) in and out of eqxdiff modules."""

from ._checkpoint import CheckpointFiles as CheckpointFiles
from ._checkpoint import check_dtype as check_dtype
from ._checkpoint import load as load
from ._checkpoint import model_class as model_class
from ._checkpoint import read_config as read_config
from ._checkpoint import resolve_folder as resolve_folder
from ._checkpoint import save_pretrained as save_pretrained
from ._checkpoint import weight_files as weight_files
from ._fill import CheckpointError as CheckpointError
from ._fill import fill_module as fill_module
from ._fill import state_dict as state_dict
from ._safetensors import SafetensorsFile as SafetensorsFile
from ._safetensors import write_safetensors as write_safetensors
