"""The flash forward kernel for Hopper GPUs (H100, H200) in Pallas Mosaic GPU: warp-specialised and TMA-pipelined.

The Triton kernel of ``_flash.py`` reaches about 0.65x cuDNN's forward throughput on an H100 (benchmarks/RESULTS.md):
Triton cannot overlap the softmax of one tile with the matrix products of another. This kernel follows the
FlashAttention-3 schedule, written with Pallas' Mosaic GPU backend:

- A program owns ``2 * block_q`` query rows of one (batch, head) and runs three warpgroups. Warpgroup 2 only moves
  data: it streams key/value tiles from global to shared memory with the tensor-copy engine (TMA) into a ring of
  ``stages`` slots, each guarded by a "ready" barrier (the copy landed) and a "free" barrier (both compute
  warpgroups are done with the slot).
- Warpgroups 0 and 1 each own ``block_q`` rows. Per key tile: ``s = q @ k.T`` and ``o += p @ v`` on the tensor
  cores (``wgmma``) with an online softmax in between (base 2, the scale folded into one multiply). A shared
  "turn" barrier makes the two warpgroups take turns, so one computes its softmax while the other's matrix
  products run.
- The output goes back through shared memory (the query's slot) with TMA, with each row's log-sum-exp for the
  backward pass, which the Triton kernels compute (``_flash.flash_backward``).

Inputs stay ``[batch, seq, heads, head_dim]`` (TMA reads the strided tiles), so no transposes run outside the kernel.
Served: bfloat16/float16, head_dim 64 or 128, no key mask, not causal (diffusion models' self- and cross-
attention); keys padded to whole tiles are masked in the last tile. Other calls use the Triton kernel.
``interpret=True`` runs the kernel in Pallas' GPU interpreter (on a CPU; for tests): the same pipeline, barriers and
softmax, with the two matrix products as plain dots (the interpreter has no transposed tiles or ``run_state``).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._block_sizes import BlockSizes
from ._common import Kernel, attention_from_kernel, pad_axis, round_up, to_bhsd
from ._flash import flash_backward

LOG2E = math.log2(math.e)
HEAD_DIMS = (64, 128)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    """Tiles of the Hopper kernel: ``block_q`` rows per compute warpgroup (a program covers twice that),
    ``block_kv`` keys per tile, ``stages`` key/value tiles in flight."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2

    def __post_init__(self):
        if self.block_q % 64 or self.block_kv % 64 or self.block_q <= 0 or self.block_kv <= 0:
            raise ValueError(f"HopperConfig: block_q={self.block_q} and block_kv={self.block_kv} must be positive "
                             f"multiples of 64 (the wgmma tile)")
        if self.stages < 1:
            raise ValueError(f"HopperConfig.stages must be >= 1, got {self.stages}")


def is_hopper(device=None) -> bool:
    """Whether ``device`` (default: the first device) is an NVIDIA GPU of compute capability 9.x."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    return device.platform == "gpu" and isinstance(capability, str) and capability.startswith("9.")


def hopper_unavailable_reason(dtype, head_dim: int, has_mask: bool, causal: bool, *, interpret: bool = False
                              ) -> str | None:
    """Why the Hopper kernel cannot serve a call (then the Triton kernel does), or ``None``."""
    if not interpret and not is_hopper():
        return "not a Hopper GPU (compute capability 9.x)"
    if jnp.dtype(dtype) not in _DTYPES:
        return f"it takes bfloat16/float16, got {jnp.dtype(dtype).name}"
    if head_dim not in HEAD_DIMS:
        return f"it takes head_dim in {HEAD_DIMS}, got {head_dim}"
    if has_mask:
        return "it takes no key mask"
    if causal:
        return "it is not causal"
    return None


def _mgpu():
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu


def _transposed(ref):
    """A ``[rows, d]`` shared-memory tile viewed as ``[d, rows]`` (the ``k.T`` operand of ``q @ k.T``)."""
    if jax.__version_info__ >= (0, 11):
        return ref.transpose((1, 0))
    return _mgpu().transpose_ref(ref, (1, 0))


def _interpret_params():
    """Pallas' GPU-interpreter settings (the class is not exported by ``jax.experimental`` in jax 0.10)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _forward_call(q, k, v, *, scale: float, kv_len: int, config: HopperConfig, interpret: bool):
    """``(out, lse2)``: ``out`` like ``q``; ``lse2`` float32 ``[b, h, q_seq]``, base 2. ``q``'s length is a multiple
    of ``2 * block_q`` and ``k``'s of ``block_kv``; keys from ``kv_len`` on are padding."""
    plgpu = _mgpu()
    batch, q_len, heads, d = q.shape
    kv_pad = k.shape[1]
    bq, bkv = config.block_q, config.block_kv
    n_kv = kv_pad // bkv
    stages = min(config.stages, n_kv)
    dtype = q.dtype
    c = scale * LOG2E  # logits -> base-2 exponents
    masked_tail = kv_len < kv_pad

    def laid_out(x, layout):  # register layouts mean nothing to the GPU interpreter
        return x if interpret else plgpu.layout_cast(x, layout)

    def kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, qo_smem, k_smem, v_smem, lse_smem,
               k_ready, v_ready, q_ready, k_free, v_free, turn):
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            rows = lax.axis_index("q_tile") * (2 * bq) + wg * bq
            q_tile = qo_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(rows, bq), h], q_tile, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
            m = laid_out(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            total = laid_out(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = laid_out(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
            plgpu.barrier_wait(k_ready.at[0])
            pl.when(wg == 1)(take_turn)  # warpgroup 1 starts half a turn behind warpgroup 0

            def step(j, carry, mask_tail=False):
                acc, m, total = carry
                slot = lax.rem(j, jnp.int32(stages))

                def logits(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, _transposed(k_smem.at[slot]))
                    take_turn()
                    return acc_ref[...]

                if interpret:  # the interpreter cannot read a transposed tile: a plain product instead
                    s = lax.dot_general(q_tile[...], k_smem.at[slot][...], (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)
                    take_turn()
                else:
                    s = pl.run_scoped(logits, plgpu.ACC((bq, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if mask_tail:
                    col = (lax.broadcasted_iota(jnp.int32, (bq, bkv), 1) if interpret else
                           plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA))
                    s = jnp.where(col + j * bkv < kv_len, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1) * c)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                total = total * alpha + p.sum(axis=1)
                p = p.astype(dtype)
                acc, total, m_new, p = lax.optimization_barrier((acc, total, m_new, p))
                plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may use the tensor cores
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)  # ... and has handed them back

                def wait_next_keys():
                    @pl.when(j + 1 < n_kv)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(j + 1, jnp.int32(stages))])

                def values(acc_ref):
                    plgpu.wgmma(acc_ref, p, v_smem.at[slot])
                    wait_next_keys()  # while the product runs

                if interpret:
                    acc = acc + lax.dot(p, v_smem.at[slot][...], preferred_element_type=jnp.float32)
                    wait_next_keys()
                else:
                    acc = pl.run_state(values)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, total

            carry = lax.fori_loop(0, n_kv - 1 if masked_tail else n_kv, step, (acc, m, total))
            if masked_tail:  # a loop of one, so the step index is a run-time value as Mosaic GPU wants
                carry = lax.fori_loop(n_kv - 1, n_kv, functools.partial(step, mask_tail=True), carry)
            acc, m, total = carry
            pl.when(wg == 0)(take_turn)  # balance warpgroup 1's head start

            acc = acc / lax.broadcast_in_dim(total, acc.shape, [0])
            q_tile[...] = acc.astype(dtype)  # the query's slot holds the output on its way out
            lse_smem.at[wg][...] = m + jnp.log(total) * LOG2E
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, o_ref.at[b, pl.ds(rows, bq), h])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(rows, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(j, slot):
                tile = (b, pl.ds(j * bkv, bkv), h)
                plgpu.copy_gmem_to_smem(k_ref.at[tile], k_smem.at[slot], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[tile], v_smem.at[slot], v_ready.at[slot])

            for i in range(stages):
                fetch(i, i)

            def refill(j, _):
                slot = lax.rem(j, jnp.int32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                fetch(j + stages, slot)
                return _

            lax.fori_loop(0, n_kv - stages, refill, None)

            def drain(j, _):  # wait out the last uses of each slot, so every barrier phase has been observed
                slot = lax.rem(j, jnp.int32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                return _

            lax.fori_loop(n_kv - stages, n_kv, drain, None)

    def entry(q_ref, k_ref, v_ref, o_ref, lse_ref):
        tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *scoped),
            plgpu.SMEM((2, bq, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bkv, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, bkv, d), dtype, transforms=tiles),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    options = {"interpret": _interpret_params()} if interpret else {}
    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)),
        grid=(heads, q_len // (2 * bq), batch),
        grid_names=("heads", "q_tile", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **options,
    )(q, k, v)


def hopper_forward(q, k, v, valid, *, scale, causal, config: HopperConfig | None = None, interpret: bool = False):
    """The forward half of a ``bshd`` :class:`Kernel`: ``(out, lse)`` with ``out`` ``[b, q_seq, h, d]`` in ``q``'s
    dtype and ``lse`` float32 ``[b, h, q_seq]`` (natural log), from ``[batch, seq, heads, head_dim]`` inputs."""
    reason = hopper_unavailable_reason(q.dtype, q.shape[-1], valid is not None, causal, interpret=interpret)
    if reason:
        raise ValueError(f"flash (Hopper kernel): {reason}")
    config = config or HopperConfig()
    q_len, kv_len = q.shape[1], k.shape[1]
    q_pad, kv_pad = round_up(q_len, 2 * config.block_q), round_up(kv_len, config.block_kv)
    out, lse2 = _forward_call(pad_axis(q, 1, q_pad), pad_axis(k, 1, kv_pad), pad_axis(v, 1, kv_pad),
                              scale=scale, kv_len=kv_len, config=config, interpret=interpret)
    return out[:, :q_len], lse2[:, :, :q_len] / LOG2E


def hopper_flash_kernel(block_sizes: BlockSizes | None = None, config: HopperConfig | None = None, *,
                        interpret: bool = False) -> Kernel:
    """A ``bshd`` :class:`Kernel`: the Hopper forward, and the Triton backward kernels (``block_sizes``; they take
    ``bhsd`` inputs) wrapped to take and give ``[batch, seq, heads, head_dim]``."""

    def bshd_backward(q, k, v, valid, do, lse, delta, *, scale, causal):
        dq, dk, dv = flash_backward(to_bhsd(q), to_bhsd(k), to_bhsd(v), valid, to_bhsd(do), lse, delta, scale=scale,
                                    causal=causal, block_sizes=block_sizes, interpret=interpret)
        return to_bhsd(dq), to_bhsd(dk), to_bhsd(dv)

    return Kernel(functools.partial(hopper_forward, config=config, interpret=interpret), bshd_backward, "bshd")


@functools.cache
def hopper_attention_fn(block_sizes: BlockSizes | None = None, interpret: bool = False):
    """``attention(q, k, v, mask, scale, causal)`` on ``[batch, seq, heads, head_dim]`` by :func:`hopper_flash_kernel`,
    differentiable."""
    return attention_from_kernel(hopper_flash_kernel(block_sizes, interpret=interpret))
