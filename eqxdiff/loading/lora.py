"""LoRA and LyCORIS files: reading them, naming the layers they adapt, building their adapters.

>>> from eqxdiff.loading import lora
>>> f = lora.read_lora("pixel-art.safetensors")           # tensors + metadata (a file, a folder or a Hub id)
>>> records, unknown = lora.parse(f.tensors)             # one record per adapted module, whatever the trainer
>>> matcher = lora.Matcher({"unet": unet}, [lora.Naming("lora_unet_", "unet", underscored=True)])
>>> matched, unmatched = matcher.match(records)
>>> adapters = lora.site_adapters(matched, f.peft_config(), lambda site: np.float32)
>>> lora.write_lora("out.safetensors", {"unet": unet}, [lora.Naming("unet.", "unet")])   # the inverse: PEFT names

Pipelines do this for their families (``pipe.load_lora_weights``); a family declares its files' namings and
layouts as data (see :mod:`eqxdiff.pipelines._lora_unet`, :mod:`eqxdiff.pipelines._lora_flux`). The scale rule is
:func:`file_scale`'s. :func:`write_lora` writes a model's adapters back under a naming (PEFT or kohya keys), through
the same layouts the reader resolves.
"""

from ._lora_build import assemble as assemble
from ._lora_build import build_adapter as build_adapter
from ._lora_build import file_scale as file_scale
from ._lora_build import rows_of as rows_of
from ._lora_file import DEFAULT_WEIGHT_NAME as DEFAULT_WEIGHT_NAME
from ._lora_file import METADATA_KEY as METADATA_KEY
from ._lora_file import ROLES as ROLES
from ._lora_file import LoraFile as LoraFile
from ._lora_file import Record as Record
from ._lora_file import lora_path as lora_path
from ._lora_file import parse as parse
from ._lora_file import peft_alpha as peft_alpha
from ._lora_file import read_lora as read_lora
from ._lora_match import Match as Match
from ._lora_match import Matcher as Matcher
from ._lora_match import NameLayout as NameLayout
from ._lora_match import Naming as Naming
from ._lora_match import same_structure as same_structure
from ._lora_match import site_adapters as site_adapters
from ._lora_models import match_models as match_models
from ._lora_models import replacements_as_differences as replacements_as_differences
from ._lora_models import widened_models as widened_models
from ._lora_names import Run as Run
from ._lora_names import layer_index as layer_index
from ._lora_write import STYLES as STYLES
from ._lora_write import layer_adapters as layer_adapters
from ._lora_write import lora_tensors as lora_tensors
from ._lora_write import write_lora as write_lora
