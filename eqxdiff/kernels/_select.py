"""What ``implementation=None`` picks, and why: by platform, dtype, sequence lengths and mesh."""

import dataclasses

import jax.numpy as jnp

from ._common import platform_of
from ._context import CONTEXT_AXIS, head_shards
from ._cudnn import cudnn_unavailable_reason

# Up to this many logits per (batch, head) the dense reference is used. On the CPU "chunked" is faster from about
# 256 x 256 on (benchmarks/attention.py: 2-3x at 1k-4k tokens); elsewhere the dense path is fast until its
# [batch, heads, q, kv] float32 logits get large (16 MiB per head at 2048 x 2048).
DENSE_MAX_LOGITS = {"cpu": 256 * 256, "gpu": 2048 * 2048, "tpu": 2048 * 2048}


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The static facts about one call that decide which implementations can serve it."""

    q_len: int
    kv_len: int
    heads: int
    head_dim: int
    dtype: str
    causal: bool
    platform: str
    mesh_axes: tuple[str, ...] | None  # None: no mesh
    context: int  # size of the mesh's context axis (1 without one)
    head_shards: int  # how many ways the heads are split over the mesh's "tensor" axis (1 without one)
    interpret: bool
    has_bias: bool = False  # an additive logits bias is given (only "xla" and "chunked" take one)

    @classmethod
    def of(cls, q, k, *, causal, mesh, interpret, has_bias=False):
        platform = platform_of(mesh.devices.flat[0].platform if mesh is not None else None)
        axes = None if mesh is None else tuple(mesh.axis_names)
        context = mesh.shape[CONTEXT_AXIS] if axes and CONTEXT_AXIS in axes else 1
        shards = 1 if mesh is None else head_shards(mesh.shape, q.shape[2])
        return cls(q.shape[1], k.shape[1], q.shape[2], q.shape[3], jnp.dtype(q.dtype).name, causal, platform, axes,
                   context, shards, interpret, has_bias)

    @property
    def local_heads(self) -> int:
        """Heads on each device of the context axis (after the split over "tensor")."""
        return self.heads // self.head_shards

    def per_device(self) -> "AttentionCall":
        """This call as each device sees it after Ulysses' all-to-all: whole sequences, a slice of the heads."""
        return dataclasses.replace(self, heads=self.local_heads // self.context, mesh_axes=None, context=1,
                                   head_shards=1)


def choose(call: AttentionCall) -> tuple[str, str]:
    """``(implementation, reason)`` for ``implementation=None``. A call with a logits bias gets "xla" or "chunked",
    the two implementations that take one."""
    if call.context > 1 and not call.has_bias:
        heads = f"{call.local_heads} heads per device" if call.head_shards > 1 else f"heads={call.heads}"
        if call.local_heads % call.context == 0:
            return "ulysses", (f"the mesh's context axis has {call.context} devices and {heads} divide by it: "
                               f"one all-to-all each way moves every token once")
        if not call.causal or call.q_len == call.kv_len:
            return "ring", (f"the mesh's context axis has {call.context} devices and {heads} do not divide by it: "
                            f"key/value shards travel round the ring")
    where = f"{call.platform}, {call.dtype}, q_seq={call.q_len} x kv_seq={call.kv_len}"
    if call.has_bias:
        where += " with a logits bias (only xla and chunked take one)"
    elif call.platform == "gpu" and cudnn_unavailable_reason(call.platform, call.dtype, call.head_dim) is None:
        return "cudnn", f"{where}: cuDNN's fused flash attention is the vendor's fastest path"
    if call.q_len * call.kv_len <= DENSE_MAX_LOGITS.get(call.platform, DENSE_MAX_LOGITS["gpu"]):
        return "xla", f"{where}: few logits per head: the dense reference"
    return "chunked", (f"{where}: many logits per head: chunked is faster on the CPU and keeps memory O(seq) "
                       f"('flash' is used only when asked for by name: on an H100 its forward matches cuDNN's but "
                       f"its backward runs at 0.4x, benchmarks/RESULTS.md)")
