"""Checks of the benchmark scripts themselves (not part of ``tests/``: run ``python -m pytest -q benchmarks``).

- the analytic Flux FLOP count (``_flux_configs.transformer_flops``, which the MFU figures divide) equals XLA's count
  of the same step, unrolled with dense attention, at the full FLUX.1 sizes and the CPU's reduced one;
- the device peak table, and the interleaved timer's turns;
- every script's smoke preset runs end to end on the CPU and its float32 outputs agree with diffusers' (the scripts'
  own ``--tolerance`` / ``--max-levels`` checks, which exit with an error otherwise), so a benchmark cannot time a
  model that computes something else.
"""

import pytest


@pytest.mark.parametrize("name", ["reduced", "dev", "schnell"])
def test_flux_flops_match_xla(name):
    import jax.numpy as jnp

    import flux_step
    from _flux_configs import PRESETS, transformer_flops
    from eqxdiff.models import flux

    preset = PRESETS[name]
    h, w, _ = preset.latent_shape
    tokens, seq = preset.image_tokens, preset.max_sequence_length
    counted = flux_step.xla_unrolled_flops(flux.FluxTransformer2DConfig(**preset.transformer), (h // 2, w // 2), seq,
                                           1, jnp.bfloat16)
    analytic = transformer_flops(preset.transformer, tokens, seq)
    # XLA also counts the elementwise work (norms, RoPE, softmax, GELU): 0.2-0.3% more at these sizes
    assert counted is not None and 1.0 <= counted / analytic < 1.01, (counted, analytic)


def test_peak_table():
    from _bench import mfu, peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.4
    assert peak_tflops("cpu") is None and mfu(1e12, 1.0, "cpu") is None
    assert mfu(989.4e12 / 2, 1.0, "NVIDIA H100 80GB HBM3") == pytest.approx(0.5)


def test_time_interleaved_takes_turns():
    from _bench import time_interleaved

    calls = []
    times = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2, warmup=1)
    assert calls == ["a", "b"] * 3
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2}
    with pytest.raises(ValueError, match="repeats=0"):
        time_interleaved({"a": lambda: None}, 0)


def _suite_commands(out):
    """Each gpu_suite.sh group's commands as the suite's dry run lists them: ``{group: [(name, limit, argv)]}``."""
    import os
    import pathlib
    import re
    import shlex
    import subprocess

    script = pathlib.Path(__file__).with_name("gpu_suite.sh")
    groups = re.findall(r"^(\w+)\)", script.read_text(), re.MULTILINE)
    commands = {}
    for group in groups:
        listed = subprocess.run(["bash", str(script), group, str(out)], capture_output=True, text=True, check=True,
                                env=dict(os.environ, GPU_SUITE_DRY_RUN="1")).stdout
        commands[group] = [(name, int(limit), argv) for name, limit, *argv in map(shlex.split, listed.splitlines())]
    return commands


def test_gpu_suite_groups_fit_a_device_call_and_parse(tmp_path):
    """Every gpu_suite.sh group's time limits add up to at most 560 s (one 600 s device call, the wheels' install
    included), and every benchmark command's flags parse (a typo would cost a device call)."""
    import importlib
    import pathlib

    import tyro

    commands = _suite_commands(tmp_path)
    assert {"tests", "wan_14b_attn", "ltx_13b"} <= set(commands)
    for group, runs in commands.items():
        assert runs and sum(limit for _, limit, _ in runs) <= 560, (group, runs)
        for name, _, argv in runs:
            assert argv[0] == "python3", (group, name, argv)
            if argv[1:3] == ["-m", "pytest"]:  # on a test file
                files = [a for a in argv if a.endswith(".py")]
                assert files and all(pathlib.Path(__file__).parent.parent.joinpath(f).is_file() for f in files), argv
                continue
            path = pathlib.Path(argv[1])
            assert path.parent.name == "benchmarks" and pathlib.Path(__file__).with_name(path.name).is_file(), argv
            module = importlib.import_module(path.stem)
            if hasattr(module, "Args"):  # attention.py's argparse flags are not checked here
                tyro.cli(module.Args, args=argv[2:])


# -- smoke runs: each script at a tiny preset, float32 outputs checked against diffusers ---------------------------


def test_unet_step_smoke(capsys):
    import unet_step

    unet_step.main(unet_step.Args(preset="sdxl-tiny", repeats=1, attention=("xla", "chunked"), tolerance=1e-4))
    out = capsys.readouterr().out
    assert out.count("ratio eqxdiff/diffusers") == 2


def test_controlnet_step_smoke(capsys):
    import controlnet_step

    controlnet_step.main(controlnet_step.Args(preset="sdxl-tiny", repeats=1, tolerance=1e-4))
    out = capsys.readouterr().out
    assert "diffusers: ControlNet overhead per step" in out and "eqxdiff: ControlNet overhead per step" in out


def test_lora_inference_smoke(capsys):
    import lora_inference

    lora_inference.main(lora_inference.Args(preset=("sdxl-tiny",), repeats=1, tolerance=1e-4))
    out = capsys.readouterr().out
    assert out.count("ratio eqxdiff/diffusers") == 3 and "diffusers: unfused / fused" in out
    # the switches of values compile nothing; the new structures (LoRA, plain, two adapters, unpadded) one each
    assert "sdxl-tiny: 0 programs compiled by the 8 switches of values" in out and "4 by the 4 new structures" in out
    assert "the timed eqxdiff steps compiled 0 programs" in out


@pytest.mark.parametrize("preset, fused, scan", [("tiny", False, True), ("tiny-schnell", True, False)])
def test_flux_step_smoke(capsys, preset, fused, scan):
    import flux_step

    flux_step.main(flux_step.Args(preset=preset, repeats=1, fused=fused, scan_layers=scan, tolerance=1e-4))
    out = capsys.readouterr().out
    assert "ratio eqxdiff [attention=auto" in out and "XLA's count of the unrolled step" in out


@pytest.mark.parametrize("preset", ["tiny", "tiny-schnell"])
def test_flux_pipeline_smoke(capsys, preset):
    import flux_pipeline

    flux_pipeline.main(flux_pipeline.Args(preset=preset, repeats=1, encoder_repeats=1, max_levels=2))
    out = capsys.readouterr().out
    assert "ratio eqxdiff/diffusers, end to end" in out and "per denoising step" in out


def test_wan_smoke(capsys):
    import wan

    wan.main(wan.Args(preset="tiny", repeats=1, tolerance=1e-4))
    out = capsys.readouterr().out
    assert "ratio eqxdiff (cached k/v)/diffusers (transformer step)" in out
    assert "ratio eqxdiff/diffusers (VAE decode)" in out


def test_wan_nothing_to_time(capsys):
    """gpu_suite.sh's wan_14b_attn command where its kernel is unavailable (cuDNN on a CPU) and diffusers is skipped:
    a clear line and a clean return, not a crash in the report of no runs."""
    import jax
    import wan

    if jax.devices()[0].platform == "gpu":
        pytest.skip("cuDNN attention is available here")
    wan.main(wan.Args(preset="tiny", part="transformer", attention=("cudnn",), skip_diffusers=True, repeats=1))
    out = capsys.readouterr().out
    assert "eqxdiff (cached k/v) skipped: AttentionUnavailableError" in out
    assert "nothing to time: no eqxdiff variant compiled and diffusers is skipped" in out


def test_ltx_smoke(capsys):
    import ltx

    ltx.main(ltx.Args(preset="tiny", repeats=1, tolerance=1e-4))
    out = capsys.readouterr().out
    assert "host: " in out and "ratio step eqxdiff/diffusers" in out and "ratio decode eqxdiff/diffusers" in out


def test_ltx_reference_built_in_the_dtype(monkeypatch):
    """ltx.py builds diffusers' models with the benchmark's dtype as PyTorch's default (on its device), not in
    float32 on the host then cast and moved: the 13B would take 52 GB of host memory and minutes to initialise."""
    import diffusers
    import ltx
    import torch

    seen = []
    for name in ("LTXVideoTransformer3DModel", "AutoencoderKLLTXVideo"):
        cls = getattr(diffusers, name)
        monkeypatch.setattr(diffusers, name, lambda *a, cls=cls, **k: seen.append(torch.get_default_dtype())
                            or cls(*a, **k))
    ref, vae = ltx.build_reference(ltx.PRESETS["tiny"], torch.device("cpu"), torch.bfloat16)
    assert seen == [torch.bfloat16, torch.bfloat16] and torch.get_default_dtype() == torch.float32
    assert {p.dtype for m in (ref, vae) for p in m.parameters()} == {torch.bfloat16}


def test_ltx_pipeline_smoke(capsys):
    import ltx
    import ltx_pipeline

    ltx.main(ltx.Args(preset="tiny", vae="0.9.0", repeats=1, tolerance=1e-4))  # 0.9.0's decoder: no timestep
    ltx_pipeline.main(ltx_pipeline.Args(preset="tiny", steps=3, distilled=True, repeats=1, max_levels=2))
    out = capsys.readouterr().out
    assert "ratio guided (3 steps, guidance 3.0) eqxdiff/diffusers, end to end" in out
    assert "ratio distilled (8 steps, no guidance) eqxdiff/diffusers, end to end" in out


def test_vae3d_block_smoke(capsys):
    import vae3d_block

    vae3d_block.main(vae3d_block.Args(stage="tiny", repeats=1, tolerance=1e-4))
    out = capsys.readouterr().out
    assert "eqxdiff block: " in out and "diffusers conv: " in out


def test_lora_train_smoke(capsys):
    import lora_train

    lora_train.main(lora_train.Args(preset="sdxl-tiny", repeats=1))  # exits if the two adapt different layers
    out = capsys.readouterr().out
    assert "ratio diffusers+peft / eqxdiff step time" in out and "eqxdiff full fine-tune" in out
