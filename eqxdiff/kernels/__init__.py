"""Attention kernels behind one call, :func:`attention`."""

from ._api import attention as attention
from ._reference import reference_attention as reference_attention
