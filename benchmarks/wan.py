"""Time Wan 2.1 / 2.2: one transformer step with classifier-free guidance (a batch of 2) and the VAE decode, eqxdiff
(jitted) against diffusers (PyTorch), the same random weights and inputs, in the same run.

    python benchmarks/wan.py                                   # CPU: Wan 2.1 1.3B's widths, 2 blocks, 17 frames
    python benchmarks/wan.py --preset tiny                     # a seconds-long smoke run
    python benchmarks/wan.py --preset 1.3b-480p --dtype bfloat16               # GPU: 81 frames at 480x832
    python benchmarks/wan.py --preset 14b-720p --dtype bfloat16 --frame-chunk 1  # GPU: 81 frames at 720x1280

A step is one forward pass of ``WanTransformer3DModel`` on the noisy latents of ``frames x height x width`` (the
positive and the negative prompt in one batch, as both pipelines run guidance), with UMT5 embeddings of 512 tokens.
eqxdiff's pipeline computes the prompts' cross-attention keys and values once per call (``cross_attention_kv``) and
passes them to every step, so its step here does too; diffusers' transformer projects the text at every step, as
its pipeline does (``--no-cached-kv`` times eqxdiff that way as well). diffusers' model is built with PyTorch's
default random initialisation on its device in the benchmark's dtype and saved; eqxdiff loads that folder (blocks
under ``lax.scan``, as the pipelines load them).

The decode is ``AutoencoderKLWan.decode`` of the latents of the same video (Wan 2.1's VAE, z 16; ``--vae 2.2``: the
TI2V-5B VAE, z 48), after one untimed warm-up. diffusers decodes frame by frame with its feature cache; eqxdiff in
one causal pass, or ``--frame-chunk N`` latent frames at a time.

Prints the host, each variant's median with its runs (the variants take turns), the load average, the model FLOPs
per step (analytic: the matmuls and attention products, formula in :func:`step_flops`), TFLOP/s, MFU on a GPU, peak
device memory of each framework, the ratios eqxdiff / diffusers and the outputs' agreement.
"""

import dataclasses
import tempfile
import time
from typing import Literal

import tyro

from _bench import (TorchDevice, check_agreement, compile_variant, fmt_seconds, gib, jax_device_name, jax_peak_bytes,
                    load_average, mfu, on_gpu, rel_error, report_cpu_times, report_times, setup_frameworks,
                    time_interleaved, torch_free, torch_peak_bytes, torch_sync)
from unet_step import check_attention

_REAL = dict(patch_size=[1, 2, 2], attention_head_dim=128, cross_attn_norm=True, eps=1e-6, freq_dim=256,
             qk_norm="rms_norm_across_heads", text_dim=4096, in_channels=16, out_channels=16)
WAN21_1_3B = dict(_REAL, num_attention_heads=12, ffn_dim=8960, num_layers=30)
WAN21_14B = dict(_REAL, num_attention_heads=40, ffn_dim=13824, num_layers=40)
TINY = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
VAE_21 = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
VAE_22 = dict(VAE_21, base_dim=160, decoder_base_dim=256, z_dim=48, in_channels=12, out_channels=12,
              is_residual=True, patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * 48,
              latents_std=[1.0] * 48)
VAE_TINY = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, True, True])


@dataclasses.dataclass(frozen=True)
class Preset:
    transformer: dict
    frames: int
    height: int
    width: int
    text_tokens: int = 512
    vae_frames: int | None = None  # the decoded video (default: the step's)
    vae_height: int | None = None
    vae_width: int | None = None
    tiny_vae: bool = False


PRESETS = {
    "tiny": Preset(TINY, 5, 32, 32, text_tokens=16, tiny_vae=True),
    # the CPU's: Wan 2.1 1.3B's widths (12 heads of 128, FFN 8960) with 2 of its 30 blocks, 17 frames at 160x256
    # (800 video tokens); the full-width 2.1 VAE decodes 5 frames at 96x128
    "reduced": Preset(dict(WAN21_1_3B, num_layers=2), 17, 160, 256, vae_frames=5, vae_height=96, vae_width=128),
    "1.3b-480p": Preset(WAN21_1_3B, 81, 480, 832),
    "14b-720p": Preset(WAN21_14B, 81, 720, 1280),
}


@dataclasses.dataclass(frozen=True)
class Args:
    """Time a Wan transformer step and the VAE decode in eqxdiff and in diffusers."""

    preset: Literal["tiny", "reduced", "1.3b-480p", "14b-720p"] = "reduced"
    """"reduced": the CPU's; "1.3b-480p" / "14b-720p": Wan 2.1 at full size, 81 frames (GPU); "tiny": smoke run."""
    part: Literal["both", "transformer", "vae"] = "both"
    """Time the transformer step, the VAE decode, or both."""
    vae: Literal["2.1", "2.2"] = "2.1"
    """Which VAE decodes: Wan 2.1's (z 16, 8x) or Wan 2.2 TI2V-5B's (z 48, 16x; the video's latents at 16x)."""
    repeats: int = 3
    """Timed runs per variant (after one untimed warm-up); the median is reported."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations dtype in both frameworks."""
    attention: tuple[str, ...] = ("auto",)
    """eqxdiff attention implementation(s) of the transformer step, each compiled and timed ("auto", or names in
    ``eqxdiff.kernels.IMPLEMENTATIONS``: e.g. ``--attention auto cudnn flash`` on a GPU)."""
    cached_kv: bool = True
    """eqxdiff's step takes the prompts' cross-attention keys/values computed once (as its pipelines run)."""
    frame_chunk: int | None = None
    """eqxdiff decodes this many latent frames at a time (default: one pass)."""
    skip_diffusers: bool = False
    """Time eqxdiff only."""
    torch_device: TorchDevice = "auto"
    """Where diffusers runs ("auto": CUDA if PyTorch sees a GPU, else the CPU)."""
    tf32: bool = True
    """On a GPU, float32 matmuls in TF32 in both frameworks."""
    tolerance: float | None = None
    """In float32: exit with an error if an eqxdiff output differs from diffusers' by more than this relative error."""


def step_flops(config: dict, tokens: int, text_tokens: int, batch: int, cached_kv: bool) -> float:
    """Model FLOPs of one step (multiply-adds count 2): per block, self-attention's q/k/v/o projections
    ``8 N d^2`` and products ``4 N^2 d``; cross-attention's q/o ``4 N d^2``, products ``4 N L d`` and (unless the
    keys/values are cached) the text's k/v ``4 L d^2``; the FFN ``4 N d f``; plus the patch embedding and output
    projection ``4 N p c d``. ``N`` video tokens, ``L`` text tokens, ``d`` the width, ``f`` the FFN width."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    n, L, f = tokens, text_tokens, config["ffn_dim"]
    patch = config["patch_size"][0] * config["patch_size"][1] * config["patch_size"][2]
    block = 8 * n * d * d + 4 * n * n * d + 4 * n * d * d + 4 * n * L * d + 4 * n * d * f
    if not cached_kv:
        block += 4 * L * d * d
    return batch * (config["num_layers"] * block + 2 * n * patch * (config["in_channels"] + config["out_channels"]) * d)


def _latent_shape(frames, height, width, spatial):
    return (frames - 1) // 4 + 1, height // spatial, width // spatial


def _run_and_report(runners, repeats, device, outputs_of, flops=None, what="step"):
    outputs = {}
    for name, run in runners.items():
        t0 = time.perf_counter()
        outputs[name] = outputs_of(run())
        print(f"{name} first {what}: {time.perf_counter() - t0:.1f}s")
    print(f"before timing: {load_average()}")
    cpu = {}
    times = time_interleaved(runners, repeats, warmup=0, cpu_times=cpu)
    print(f"after timing: {load_average()}")
    med = report_times(times, what)
    if not on_gpu() and device.type == "cpu":
        report_cpu_times(cpu, "diffusers", times)
    if flops:
        for name, m in med.items():
            u = mfu(flops, m, jax_device_name())
            print(f"{name}: {flops / m / 1e12:.3g} TFLOP/s" + ("" if u is None else f", MFU {100 * u:.1f}%"))
    return outputs, med


def _compare(outputs, med, labels, args, what):
    if "diffusers" not in med:
        return
    errors = {}
    for label in labels:
        errors[label] = rel_error(outputs[label], outputs["diffusers"])
        print(f"ratio {label}/diffusers ({what}): {med[label] / med['diffusers']:.2f} ({fmt_seconds(med[label])} vs "
              f"{fmt_seconds(med['diffusers'])})   (outputs agree to relative error {errors[label]:.1e})")
    check_agreement(errors, args.dtype, args.tolerance)


def bench_transformer(args, preset, device, torch_dtype):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from eqxdiff.kernels import explain_choice
    from eqxdiff.nn import with_attention_implementation

    check_attention(args.attention)
    cfg = preset.transformer
    f, h, w = _latent_shape(preset.frames, preset.height, preset.width, 8)
    tokens = f * (h // 2) * (w // 2)
    flops = step_flops(cfg, tokens, preset.text_tokens, 2, args.cached_kv)
    print(f"transformer: {cfg['num_layers']} blocks of width {cfg['num_attention_heads'] * cfg['attention_head_dim']}"
          f"; {preset.frames} frames at {preset.width}x{preset.height}: latents {f}x{h}x{w}, {tokens} video + "
          f"{preset.text_tokens} text tokens, batch 2 (CFG); {flops / 1e12:.4g} TFLOP per step (analytic)")
    t0 = time.perf_counter()
    models, parameters = build_models(cfg, device, args.dtype, torch_dtype, args.skip_diffusers)
    model, ref = models["eqxdiff"], models.get("diffusers")
    print(f"built, saved and loaded the transformer in {time.perf_counter() - t0:.1f}s "
          f"({parameters / 1e6:,.1f}M parameters)" + (", diffusers' copy freed (--skip-diffusers)"
                                                      if ref is None else ""))
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, f, h, w, cfg["in_channels"]), np.float32)
    embeds = rng.standard_normal((2, preset.text_tokens, cfg["text_dim"]), np.float32)
    timestep = np.full((2,), 757.0, np.float32)
    jdt = jnp.dtype(args.dtype)
    j_latents, j_embeds, j_t = jnp.asarray(latents, jdt), jnp.asarray(embeds, jdt), jnp.asarray(timestep)
    heads, head_dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
    q = jax.ShapeDtypeStruct((2, tokens, heads, head_dim), jdt)
    print(f"self-attention [2, {tokens}, {heads}, {head_dim}], auto picks {explain_choice(q, q)}")
    runners, labels = {}, []
    for name in args.attention:
        params, static = eqx.partition(with_attention_implementation(model, None if name == "auto" else name),
                                       eqx.is_array)
        if args.cached_kv:
            kv = jax.jit(lambda p, e, s=static: eqx.combine(p, s).cross_attention_kv(e, dtype=jdt))(params, j_embeds)

            def step(p, x, t, kv, s=static):
                return eqx.combine(p, s)(x, t, cross_kv=kv)
            step_args = (j_latents, j_t, kv)
        else:
            def step(p, x, t, e, s=static):
                return eqx.combine(p, s)(x, t, e)
            step_args = (j_latents, j_t, j_embeds)
        label = "eqxdiff" + (" (cached k/v)" if args.cached_kv else "") + (
            f" [attention={name}]" if len(args.attention) > 1 else "")
        if (compiled := compile_variant(label, step, params, *step_args)) is None:
            continue
        runners[label] = lambda c=compiled, p=params, a=step_args: jax.block_until_ready(c(p, *a))
        labels.append(label)
    if not labels:
        print(f"nothing to time for eqxdiff: every --attention variant ({' '.join(args.attention)}) was skipped "
              f"(the reasons above)")
    if ref is not None:
        kwargs = dict(hidden_states=torch.from_numpy(latents).permute(0, 4, 1, 2, 3).to(device, torch_dtype),
                      timestep=torch.from_numpy(timestep).to(device),
                      encoder_hidden_states=torch.from_numpy(embeds).to(device, torch_dtype))

        def run_ref():
            with torch.no_grad():
                out = ref(**kwargs, return_dict=False)[0]
            torch_sync(device)
            return out.permute(0, 2, 3, 4, 1)
        runners["diffusers"] = run_ref
    if not runners:
        print("nothing to time: no eqxdiff variant compiled and diffusers is skipped (--skip-diffusers)")
        return
    outputs, med = _run_and_report(runners, args.repeats, device, _to_numpy, flops, "step")
    _compare(outputs, med, labels, args, "transformer step")


def build_models(cfg: dict, device, dtype: str, torch_dtype, skip_diffusers: bool) -> tuple[dict, int]:
    """diffusers' random ``WanTransformer3DModel`` (PyTorch's default initialisation, built straight on ``device``
    in ``torch_dtype``: the 14B is 28 GB in bf16) saved to a scratch folder and loaded by eqxdiff; returns
    ``{"eqxdiff": model, "diffusers": reference}`` and the parameter count. The reference is read back from the
    folder as diffusers loads it (its float32 modules: ``_keep_in_fp32_modules``); with ``skip_diffusers`` it is
    left out and its memory handed back before eqxdiff loads, so nothing of PyTorch's stays on the device."""
    import diffusers
    import torch
    from _flux_configs import torch_defaults

    import eqxdiff

    torch.manual_seed(0)
    with torch_defaults(device, torch_dtype):
        built = diffusers.WanTransformer3DModel(**cfg).eval()
    parameters = sum(p.numel() for p in built.parameters())
    models = {}
    with tempfile.TemporaryDirectory() as folder:
        built.save_pretrained(folder)
        if skip_diffusers or torch_dtype != torch.float32:
            del built
            torch_free(device)
            if not skip_diffusers:
                models["diffusers"] = diffusers.WanTransformer3DModel.from_pretrained(
                    folder, torch_dtype=torch_dtype).to(device).eval()
        else:
            models["diffusers"] = built
        models["eqxdiff"] = eqxdiff.load(folder, dtype=dtype)
    return models, parameters


def bench_vae(args, preset, device, torch_dtype):
    import diffusers
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from _flux_configs import torch_defaults

    import eqxdiff

    config = VAE_TINY if preset.tiny_vae else (VAE_21 if args.vae == "2.1" else VAE_22)
    spatial = 16 if args.vae == "2.2" and not preset.tiny_vae else 8
    frames = preset.vae_frames or preset.frames
    f, h, w = _latent_shape(frames, preset.vae_height or preset.height, preset.vae_width or preset.width, spatial)
    print(f"VAE {args.vae if not preset.tiny_vae else 'tiny'} decode: latents {f}x{h}x{w}x{config['z_dim']} -> "
          f"{frames} frames at {w * spatial}x{h * spatial}" + (f", {args.frame_chunk} latent frame(s) at a time"
                                                             if args.frame_chunk else ""))
    torch.manual_seed(1)
    with torch_defaults(device, torch_dtype):  # built in the dtype: the Wan VAE keeps no module in float32
        ref = diffusers.AutoencoderKLWan(**config).eval()
    with tempfile.TemporaryDirectory() as folder:
        ref.save_pretrained(folder)
        if args.skip_diffusers:
            del ref
            torch_free(device)
        vae = eqxdiff.load(folder, dtype=args.dtype)
    z = np.random.default_rng(1).standard_normal((1, f, h, w, config["z_dim"]), np.float32)
    jz = jnp.asarray(z, jnp.dtype(args.dtype))
    decode = jax.jit(lambda vae, z: vae.decode(z, frame_chunk=args.frame_chunk))
    runners = {"eqxdiff": lambda: jax.block_until_ready(decode(vae, jz))}
    if not args.skip_diffusers:
        tz = torch.from_numpy(z).permute(0, 4, 1, 2, 3).to(device, torch_dtype)

        def run_ref():
            with torch.no_grad():
                out = ref.decode(tz, return_dict=False)[0]
            torch_sync(device)
            return out.permute(0, 2, 3, 4, 1)
        runners["diffusers"] = run_ref
    outputs, med = _run_and_report(runners, args.repeats, device, _to_numpy, None, "decode")
    _compare(outputs, med, ["eqxdiff"], args, "VAE decode")


def _to_numpy(out):
    import numpy as np

    return np.asarray(out.float().cpu() if hasattr(out, "cpu") else out, np.float32)


def main(args: Args) -> None:
    import torch

    device, header = setup_frameworks(args.torch_device, args.tf32)
    preset = PRESETS[args.preset]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    print(f"{header}; preset={args.preset} dtype={args.dtype}")
    if args.part in ("both", "transformer"):
        bench_transformer(args, preset, device, torch_dtype)
        torch_free(device)  # the transformer's reference, gone with its function, handed back to the device
    if args.part in ("both", "vae"):
        bench_vae(args, preset, device, torch_dtype)
    for name, peak in (("eqxdiff", jax_peak_bytes()), ("diffusers", None if args.skip_diffusers
                                                        else torch_peak_bytes(device))):
        if peak is not None:
            print(f"peak device memory, {name}: {gib(peak)}")


if __name__ == "__main__":
    main(tyro.cli(Args))
