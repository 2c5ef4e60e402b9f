"""Where a video VAE decode spends its time: one ResNet block of LTX-Video's VAE decoder (and its parts) at a
decoder stage's full size, eqxdiff (jitted) against diffusers (PyTorch), the same random weights, in the same run.

    python benchmarks/vae3d_block.py --stage tiny                          # a smoke run on the CPU
    python benchmarks/vae3d_block.py --stage last --dtype bfloat16         # GPU: 128 channels, 121 x 512 x 768 / 4

A block is ``LTXVideoResnetBlock3d`` (RMS norm, SiLU, a replicate-padded 3x3x3 convolution, twice, plus the
shortcut), non-causal as in the decoder. Its parts, timed alone in eqxdiff: the convolution as eqxdiff runs it
(channels-last, NDHWC with DHWIO weights), the same convolution channels-first (NCDHW / OIDHW, as PyTorch stores it),
and the RMS norm; in diffusers: the convolution (``LTXVideoCausalConv3d``). The LTX-Video 2B decode of 121 frames at
768x512 (0.9.0's decoder) runs four such blocks at the "last" stage's size and more at the smaller ones.

Prints each variant's median with its runs and the ratios to diffusers' block.
"""

import dataclasses
import time
from typing import Literal

import tyro

from _bench import TorchDevice, report_times, setup_frameworks, time_interleaved, torch_runner

STAGES = {  # (frames, height, width, channels) of a decoder stage's activations
    "last": (121, 128, 192, 128),  # 0.9.0's last up block: 121 frames at 768x512 before the 4x4 unpatchify
    "third": (61, 64, 96, 256),
    "tiny": (5, 8, 8, 8),
}


@dataclasses.dataclass(frozen=True)
class Args:
    """Time one LTX-Video VAE decoder ResNet block and its parts in eqxdiff and in diffusers."""

    stage: Literal["last", "third", "tiny"] = "tiny"
    """The activations' size: "last" / "third": the 2B decode's 121 frames at 768x512 (a GPU); "tiny": smoke."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    repeats: int = 5
    torch_device: TorchDevice = "auto"
    tf32: bool = True
    tolerance: float | None = None
    """In float32: exit with an error if the blocks' outputs differ by more than this relative error."""


def main(args: Args) -> None:
    import diffusers.models.autoencoders.autoencoder_kl_ltx as ltx
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from eqxdiff.loading import TensorDict
    from eqxdiff.loading._fill import fill_module
    from eqxdiff.models._ltx_vae_blocks import LTXVideoResnetBlock3d

    device, header = setup_frameworks(args.torch_device, args.tf32)
    f, h, w, c = STAGES[args.stage]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    jdt = jnp.dtype(args.dtype)
    print(f"{header}\nstage={args.stage}: [1, {f}, {h}, {w}, {c}] ({f * h * w * c * jdt.itemsize / 2**20:.0f} MiB "
          f"per activation), dtype={args.dtype}")
    torch.manual_seed(0)
    ref = ltx.LTXVideoResnetBlock3d(c, c, is_causal=False).to(device=device, dtype=torch_dtype).eval()
    state = TensorDict({k: v.float().cpu().numpy() for k, v in ref.state_dict().items()})
    block = fill_module(eqx.filter_eval_shape(lambda: LTXVideoResnetBlock3d(c, c, causal=False, dtype=jdt,
                                                                            key=jax.random.key(0))), state, dtype=jdt)
    x = np.random.default_rng(0).standard_normal((1, f, h, w, c), np.float32)
    jx = jnp.asarray(x, jdt)
    tx = torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, -1, 1))).to(device, torch_dtype)
    params, static = eqx.partition(block, eqx.is_array)
    weight = block.conv1.conv.weight

    def ncdhw(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1, 1), [(1, 1)] * 3,
                                            dimension_numbers=("NCDHW", "OIDHW", "NCDHW"))

    jobs = {"eqxdiff block": (lambda p, x: eqx.combine(p, static)(x), (params, jx)),
            "eqxdiff conv (NDHWC)": (lambda k, x: eqx.combine(k, eqx.partition(block.conv1, eqx.is_array)[1])(x),
                                     (eqx.partition(block.conv1, eqx.is_array)[0], jx)),
            "eqxdiff conv (NCDHW)": (ncdhw, (jnp.moveaxis(jx, -1, 1), jnp.transpose(weight, (4, 3, 0, 1, 2)))),
            "eqxdiff RMS norm": (lambda x: block.norm1(x), (jx,))}
    runners, outputs = {}, {}
    for name, (fn, a) in jobs.items():
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*a).compile()
        print(f"{name}: compiled in {time.perf_counter() - t0:.1f}s")
        runners[name] = (lambda compiled=compiled, a=a: jax.block_until_ready(compiled(*a)))

    runners["diffusers block"] = torch_runner(lambda: ref(tx), device)
    runners["diffusers conv"] = torch_runner(lambda: ref.conv1(tx), device)
    for name, run in runners.items():
        outputs[name] = run()
    mine = np.asarray(outputs["eqxdiff block"], np.float32)
    theirs = np.moveaxis(outputs["diffusers block"].float().cpu().numpy(), 1, -1)
    error = np.abs(mine - theirs).max() / np.abs(theirs).max()
    print(f"blocks agree to relative error {error:.1e}")
    if args.tolerance is not None and args.dtype == "float32" and not error <= args.tolerance:
        raise SystemExit(f"eqxdiff's block differs from diffusers' by {error:.1e} (--tolerance {args.tolerance})")
    times = time_interleaved(runners, args.repeats, warmup=1)
    med = report_times(times, "")
    for name, m in med.items():
        print(f"{name}: {m / med['diffusers block']:.2f}x diffusers' block")


if __name__ == "__main__":
    main(tyro.cli(Args))
