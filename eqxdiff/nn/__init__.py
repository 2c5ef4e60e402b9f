"""Channels-last layers that load from PyTorch checkpoints."""

from ._attention import ATTENTION_NAMES as ATTENTION_NAMES
from ._attention import Attention as Attention
from ._attention import with_attention_implementation as with_attention_implementation
from ._embeddings import TextProjection as TextProjection
from ._embeddings import TimestepEmbedding as TimestepEmbedding
from ._embeddings import timestep_embedding as timestep_embedding
from ._layers import Conv2d as Conv2d
from ._layers import Embedding as Embedding
from ._layers import GroupNorm as GroupNorm
from ._layers import LayerNorm as LayerNorm
from ._layers import Linear as Linear
from ._layers import RMSNorm as RMSNorm
from ._layers import activation as activation
from ._resnet import Downsample2D as Downsample2D
from ._resnet import ResnetBlock2D as ResnetBlock2D
from ._resnet import Upsample2D as Upsample2D
from ._stack import Stacked as Stacked
from ._stack import run_layers as run_layers
from ._stack import scan_layers as scan_layers
