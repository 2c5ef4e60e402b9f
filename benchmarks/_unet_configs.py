"""What the UNet benchmarks (``unet_step.py``, ``train_step.py``) share: the UNet presets, the flags both take,
and the set-up of both frameworks on one machine (which device PyTorch runs on, TF32 or full float32 matmuls,
peak device memory).

The scripts import this as ``from _unet_configs import ...``: run as ``python benchmarks/<script>.py``, the
script's own folder is first on ``sys.path``.
"""

import dataclasses
import os
from typing import Literal

PRESETS = {
    "sd15": dict(attention_head_dim=8, block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768,
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",), layers_per_block=2,
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, sample_size=64),
    "tiny": dict(attention_head_dim=2, block_out_channels=(32, 64), cross_attention_dim=32, norm_num_groups=8,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), layers_per_block=1,
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), sample_size=16),
}

TorchDevice = Literal["auto", "cpu", "cuda"]


@dataclasses.dataclass(frozen=True)
class UNetBenchmarkArgs:
    """The flags both UNet benchmarks take; each script's ``Args`` adds its own."""

    preset: Literal["sd15", "tiny"] = "sd15"
    """UNet config: the full-size Stable Diffusion 1.5 UNet, or a tiny one for a smoke run."""
    batch: int = 1
    """Images per step (unet_step: the UNet runs on 2 * batch latents, unconditional + conditional)."""
    repeats: int = 3
    """Timed steps per framework (after one untimed warm-up step); the median is reported."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations dtype in both frameworks (train_step: gradients and AdamW moments too; pure, not
    mixed precision)."""
    text_tokens: int = 77
    """Text sequence length."""
    skip_diffusers: bool = False
    """Time eqxdiff only."""
    torch_device: TorchDevice = "auto"
    """Where diffusers runs ("auto": CUDA if PyTorch sees a GPU, else the CPU)."""
    tf32: bool = True
    """On a GPU, float32 matmuls and convolutions in TF32 in both frameworks (JAX's GPU default); --no-tf32: full
    float32 in both. Nothing changes on the CPU."""


def setup_frameworks(torch_device: TorchDevice, tf32: bool):
    """Set JAX and PyTorch up for one benchmark process; returns ``(torch.device, header line)``.

    Call before anything touches a JAX device. JAX is told not to preallocate 75% of the GPU (unless
    ``XLA_PYTHON_CLIENT_PREALLOCATE`` is set already), so PyTorch in the same process gets the memory it needs.

    ``tf32`` picks the float32 matmul/convolution precision on a GPU, the same in both frameworks. JAX's default
    precision on a GPU already uses TF32 for float32 dots and convolutions on Ampere and newer (H100 included),
    while PyTorch's default is full float32 for matmuls (TF32 for cuDNN convolutions), so without this the two
    would not compute the same thing. On the CPU there is no TF32 and nothing is changed.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import torch

    if torch_device == "auto":
        torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch_device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"torch_device='cuda' but this PyTorch ({torch.__version__}) sees no CUDA device; "
                         f"use --torch-device cpu or auto")
    device = torch.device(torch_device)
    platform = jax.devices()[0].platform
    if platform == "gpu":
        jax.config.update("jax_default_matmul_precision", "tensorfloat32" if tf32 else "highest")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    precision = "tf32" if tf32 else "full float32"
    line = (f"jax {jax.__version__} on {platform} ({jax.devices()[0].device_kind}, float32 matmuls: "
            f"{precision if platform == 'gpu' else 'default'}); torch {torch.__version__} on {device}"
            + (f" ({torch.cuda.get_device_name(device)}, float32 matmuls: {precision})" if device.type == "cuda"
               else f" ({torch.get_num_threads()} threads)"))
    return device, line


def torch_sync(device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously); call before reading a clock."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_peak_bytes(device) -> int | None:
    """Peak memory PyTorch's allocator has handed out on ``device`` since the start or the last reset."""
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def jax_peak_bytes() -> int | None:
    """Peak bytes in use on JAX's first device since the process started (GPU/TPU; the CPU keeps no count)."""
    import jax

    try:
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None


def compiled_bytes(compiled) -> int | None:
    """Device memory one call of a compiled JAX function needs by XLA's own account: arguments, temporaries and
    the outputs that do not reuse a donated argument. Unlike :func:`jax_peak_bytes` it leaves out the scratch
    XLA's GPU autotuner allocates while compiling (on an H100 the SD 1.5 float32 train step's process peak read
    36.8 GiB, PyTorch's 16.2 GiB, with the allocator logging autotuning attempts at 38-52 GiB).
    ``compiled``: what ``jax.jit(f).lower(...).compile()`` or ``eqx.filter_jit(f).lower(...).compile()`` return."""
    try:
        m = getattr(compiled, "compiled", compiled).memory_analysis()
        return m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    except Exception:  # noqa: BLE001 - a backend without memory analysis: a report line is not worth a crash
        return None


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
