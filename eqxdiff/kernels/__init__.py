"""Attention kernels behind one call, :func:`attention`; :data:`IMPLEMENTATIONS` lists the backends."""

from ._api import IMPLEMENTATIONS as IMPLEMENTATIONS
from ._api import Implementation as Implementation
from ._api import attention as attention
from ._api import explain_choice as explain_choice
from ._block_sizes import BlockSizes as BlockSizes
from ._common import AttentionUnavailableError as AttentionUnavailableError
from ._context import CONTEXT_KERNELS as CONTEXT_KERNELS
from ._reference import reference_attention as reference_attention
