"""Time LTX-Video's transformer step and VAE decode, eqxdiff (jitted) against diffusers (PyTorch), same random
weights, same run.

    python benchmarks/ltx.py                        # the CPU's reduced configs (see PRESETS)
    python benchmarks/ltx.py --preset tiny          # a seconds-long smoke run
    python benchmarks/ltx.py --preset 2b --dtype bfloat16 --repeats 5    # GPU: 2B at 768x512 x 121 frames
    python benchmarks/ltx.py --preset 13b --dtype bfloat16 --repeats 3   # GPU: 13B (0.9.7/0.9.8), the same video

A step is one forward pass of ``LTXVideoTransformer3DModel`` on the packed latents of one video (what each of a
pipeline's steps runs without guidance; batch 2 is a guided step), T5 embeddings of ``text_tokens`` tokens with their
mask, the rotary positions from the frame rate (built once outside the step, as eqxdiff's pipeline does; diffusers
builds them every call, as its pipeline does). The decode is ``AutoencoderKLLTXVideo.decode`` of those latents at
``decode_timestep`` 0.05 (0.9.5's timestep-conditioned decoder, no injected noise), one pass. diffusers' models are
built with PyTorch's default initialisation straight on its device in the benchmark's dtype (LTX-Video keeps no
module in float32) and saved; eqxdiff loads those folders.

Prints the host (CPU model and the ISA extensions XLA and PyTorch use), each variant's median with its runs (after one
untimed warm-up; the variants take turns), CPU times, the ratios eqxdiff / diffusers and the outputs' agreement.
"""

import dataclasses
import tempfile
import time
from typing import Literal

import tyro

from _bench import (TorchDevice, check_agreement, fmt_seconds, load_average, on_gpu, rel_error, report_cpu_times,
                    report_times, setup_frameworks, time_interleaved, torch_runner)

_LTX_2B = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
               attention_head_dim=64, cross_attention_dim=2048, num_layers=28, caption_channels=4096)
# LTX-Video 13B (0.9.7 / 0.9.8: ltxv-13b-0.9.x-dev / -distilled): 32 heads of 128, 48 layers
_LTX_13B = dict(_LTX_2B, attention_head_dim=128, cross_attention_dim=4096, num_layers=48)
_VAE_095 = dict(in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(128, 256, 512, 1024, 2048),
                decoder_block_out_channels=(256, 512, 1024), layers_per_block=(4, 6, 6, 2, 2),
                decoder_layers_per_block=(5, 5, 5, 5), spatio_temporal_scaling=(True, True, True, True),
                decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False, False, False, False),
                down_block_types=("LTXVideo095DownBlock3D",) * 4, upsample_residual=(True, True, True),
                upsample_factor=(2, 2, 2), timestep_conditioning=True, patch_size=4,
                downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                spatial_compression_ratio=32, temporal_compression_ratio=8)
_TINY_VAE = dict(_VAE_095, latent_channels=8, block_out_channels=(8, 16, 32, 32, 64),
                 decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1, 1),
                 decoder_layers_per_block=(1, 1, 1, 1), patch_size=2, spatial_compression_ratio=16)

# 0.9.0's VAE (the paper's; diffusers' defaults): no decoder timestep, 0.9.0 up blocks
_VAE_090 = dict(spatial_compression_ratio=32, temporal_compression_ratio=8)
_TINY_VAE_090 = dict(latent_channels=8, block_out_channels=(8, 16, 16, 16), decoder_block_out_channels=(8, 16, 16, 16),
                     layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1), patch_size=2,
                     spatial_compression_ratio=16, temporal_compression_ratio=8)
_REDUCED_VAE = dict(_VAE_095, block_out_channels=(8, 16, 32, 32, 64), layers_per_block=(1, 1, 1, 1, 1),
                    decoder_layers_per_block=(1, 1, 1, 1))


@dataclasses.dataclass(frozen=True)
class Preset:
    transformer: dict
    vae: dict
    frames: int
    height: int
    width: int
    text_tokens: int = 128
    decode_frames: int | None = None  # the decode's frames, if fewer than the step's (the CPU's memory and time)


PRESETS = {
    # GPU: LTX-Video 2B (0.9.5's VAE) at 768x512 x 121 frames (the paper's 5 s at 24 fps): 6144 tokens
    "2b": Preset(_LTX_2B, _VAE_095, 121, 512, 768),
    # GPU: LTX-Video 13B at the same size (0.9.7's VAE is 0.9.5's layout)
    "13b": Preset(_LTX_13B, _VAE_095, 121, 512, 768),
    # CPU: the 2B's widths with 2 of its 28 blocks at 384x256 x 25 frames (384 tokens); the 0.9.5 decoder's widths
    # with one ResNet per block (and a narrow encoder, unused: the machine's memory) on 9 frames at 384x256
    "reduced": Preset(dict(_LTX_2B, num_layers=2), _REDUCED_VAE, 25, 256, 384, decode_frames=9),
    "tiny": Preset(dict(_LTX_2B, in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8,
                        cross_attention_dim=32, num_layers=2, caption_channels=16), _TINY_VAE, 9, 32, 32, 16),
}


@dataclasses.dataclass(frozen=True)
class Args:
    """Time LTX-Video's transformer step and VAE decode in eqxdiff and in diffusers."""

    preset: Literal["2b", "13b", "reduced", "tiny"] = "reduced"
    """"2b": full size at 768x512 x 121 frames (GPU); "reduced": the CPU's (2 blocks, 384x256); "tiny": a smoke run."""
    batch: int = 1
    """Videos per step (2: a guided step's [negative; positive])."""
    repeats: int = 3
    """Timed runs per variant (after one untimed warm-up); the median is reported."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations dtype in both frameworks."""
    vae: Literal["0.9.5", "0.9.0"] = "0.9.5"
    """The VAE's config: 0.9.5's timestep-conditioned decoder, or 0.9.0's (the paper's; full-size and tiny presets)."""
    skip_decode: bool = False
    """Time the transformer step only."""
    torch_device: TorchDevice = "auto"
    """Where diffusers runs ("auto": CUDA if PyTorch sees a GPU, else the CPU)."""
    tf32: bool = True
    """On a GPU, float32 matmuls in TF32 in both frameworks."""
    tolerance: float | None = None
    """In float32: exit with an error if an output differs from diffusers' by more than this relative error."""


def host_line() -> str:
    """The host CPU's model and the vector ISA extensions it has (what XLA's and PyTorch's CPU kernels can use)."""
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                       "amx_tile") if f in flags]
    return f"host: {model}; ISA: {' '.join(isa) or 'unknown'}"


def time_stage(stage: str, runners, repeats: int, device) -> float:
    """One stage's first calls (the outputs compared: diffusers' decode is NCTHW), then ``repeats`` interleaved timed
    runs, their medians, CPU times and ratio; returns eqxdiff's relative error to diffusers."""
    import numpy as np

    first = {}
    for name, run in runners.items():
        t0 = time.perf_counter()
        out = run()
        out = np.asarray(out.float().cpu() if hasattr(out, "cpu") else out, np.float32)
        first[name] = np.moveaxis(out, 1, -1) if stage == "decode" and name == "diffusers" else out
        print(f"{stage}, {name}, first call: {time.perf_counter() - t0:.1f}s")
    error = rel_error(first["eqxdiff"], first["diffusers"])
    print(f"{stage} before timing: {load_average()}")
    cpu = {}
    times = time_interleaved(runners, repeats, warmup=0, cpu_times=cpu)
    med = report_times(times, stage)
    if not on_gpu() and device.type == "cpu":
        report_cpu_times(cpu, "diffusers", times)
    print(f"ratio {stage} eqxdiff/diffusers: {med['eqxdiff'] / med['diffusers']:.2f} ({fmt_seconds(med['eqxdiff'])} "
          f"vs {fmt_seconds(med['diffusers'])})   (outputs agree to relative error {error:.1e})")
    return error


def decode_runners(vae, ref_vae, latents, preset: Preset, device, jdt, torch_run, tt) -> dict:
    """The decode stage: both VAEs on the first latent frames of ``latents`` (the preset's ``decode_frames``) at
    decode_timestep 0.05, eqxdiff's jitted and compiled here."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    vae_t, batch = preset.vae["temporal_compression_ratio"], latents.shape[0]
    frames = preset.decode_frames or preset.frames
    z = latents[:, :(frames - 1) // vae_t + 1].astype(np.float32)
    v_params, v_static = eqx.partition(vae, eqx.is_array)
    conditioned = preset.vae.get("timestep_conditioning", False)
    v_args = (jnp.asarray(z, jdt), jnp.full((batch,), 0.05, jnp.float32) if conditioned else None)

    def decode(v_params, z, temb):
        return eqx.combine(v_params, v_static).decode(z, temb)

    compiled = jax.jit(decode).lower(v_params, *v_args).compile()
    z_t = tt(np.moveaxis(z, -1, 1))
    temb = tt(np.full((batch,), 0.05, np.float32)) if conditioned else None
    print(f"decode: {frames} frames at {preset.width}x{preset.height}")
    return {"eqxdiff": lambda: jax.block_until_ready(compiled(v_params, *v_args)),
            "diffusers": torch_run(lambda: ref_vae.decode(z_t, temb, return_dict=False)[0])}


def build_reference(preset: Preset, device, torch_dtype, skip_decode: bool = False):
    """diffusers' random transformer and VAE (``None`` with ``skip_decode``), PyTorch's default initialisation, built
    straight on ``device`` in ``torch_dtype``: the 13B is 26 GB in bf16, not 52 GB of float32 on the host first. Then
    every parameter is in ``torch_dtype``, as ``from_pretrained(torch_dtype=...)`` loads them (LTX-Video keeps none in
    float32; the 0.9.5 decoder's ``timestep_scale_multiplier`` is made in float32 explicitly)."""
    import diffusers
    import torch
    from _flux_configs import torch_defaults

    torch.manual_seed(0)
    with torch_defaults(device, torch_dtype):  # then cast: a few parameters are made in float32 whatever the default
        ref = diffusers.LTXVideoTransformer3DModel(**preset.transformer).to(torch_dtype).eval()
        ref_vae = None if skip_decode else diffusers.AutoencoderKLLTXVideo(**preset.vae).to(torch_dtype).eval()
    return ref, ref_vae


def main(args: Args) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import eqxdiff
    from eqxdiff.models.ltx import pack_latents

    device, header = setup_frameworks(args.torch_device, args.tf32)
    preset = PRESETS[args.preset]
    if args.vae == "0.9.0":
        preset = dataclasses.replace(preset, vae=_TINY_VAE_090 if args.preset == "tiny" else _VAE_090)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    jdt = jnp.dtype(args.dtype)
    vae_f, vae_t = preset.vae["spatial_compression_ratio"], preset.vae["temporal_compression_ratio"]
    t, h, w = (preset.frames - 1) // vae_t + 1, preset.height // vae_f, preset.width // vae_f
    c = preset.transformer["in_channels"]
    print(f"{header}\n{host_line()}\npreset={args.preset}: {preset.width}x{preset.height} x {preset.frames} frames "
          f"({t * h * w} tokens, {preset.text_tokens} text), dtype={args.dtype}, batch={args.batch}")

    t0 = time.perf_counter()
    ref, ref_vae = build_reference(preset, device, torch_dtype, args.skip_decode)
    with tempfile.TemporaryDirectory() as folder:
        ref.save_pretrained(f"{folder}/transformer")
        model = eqxdiff.load(f"{folder}/transformer", dtype=args.dtype)
        if ref_vae is not None:
            ref_vae.save_pretrained(f"{folder}/vae")
            vae = eqxdiff.load(f"{folder}/vae", dtype=args.dtype)
    print(f"built, saved and loaded in {time.perf_counter() - t0:.1f}s "
          f"({sum(p.numel() for p in ref.parameters()) / 1e6:,.1f}M transformer parameters)")

    rng = np.random.default_rng(0)
    latents = rng.standard_normal((args.batch, t, h, w, c), np.float32)
    embeds = rng.standard_normal((args.batch, preset.text_tokens, preset.transformer["caption_channels"]), np.float32)
    mask = np.ones((args.batch, preset.text_tokens), np.int32)
    mask[:, preset.text_tokens * 3 // 4:] = 0
    timestep = np.full((args.batch,), 700.0, np.float32)
    scale = (vae_t / 24.0, float(vae_f), float(vae_f))
    rope = jax.tree.map(jnp.asarray, model.rotary_embedding((t, h, w), scale))
    tokens = jnp.asarray(pack_latents(jnp.asarray(latents)), jdt)
    j_args = (tokens, jnp.asarray(embeds, jdt), jnp.asarray(timestep), jnp.asarray(mask), rope)
    params, static = eqx.partition(model, eqx.is_array)

    def step(params, *a):
        return eqx.combine(params, static).forward_tokens(*a)

    def tt(a, dtype=torch_dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    t_kwargs = dict(hidden_states=tt(latents.reshape(args.batch, -1, c)), encoder_hidden_states=tt(embeds),
                    timestep=tt(timestep, torch.float32), encoder_attention_mask=tt(mask, torch.bool),
                    num_frames=t, height=h, width=w, rope_interpolation_scale=scale, return_dict=False)

    def torch_run(fn):
        return torch_runner(fn, device)

    stages = {"step": {"eqxdiff": jax.jit(step).lower(params, *j_args).compile(),
                       "diffusers": torch_run(lambda: ref(**t_kwargs)[0])}}
    stages["step"]["eqxdiff"] = (lambda compiled=stages["step"]["eqxdiff"]:
                                 jax.block_until_ready(compiled(params, *j_args)))
    if ref_vae is not None:
        stages["decode"] = decode_runners(vae, ref_vae, latents, preset, device, jdt, torch_run, tt)
    errors = {}
    for stage, runners in stages.items():
        errors[f"{stage} (eqxdiff)"] = time_stage(stage, runners, args.repeats, device)
    print(f"after timing: {load_average()}")
    check_agreement(errors, args.dtype, args.tolerance)


if __name__ == "__main__":
    main(tyro.cli(Args))
