"""LoRA at inference: the unfused adapter path's overhead per classifier-free-guided UNet step against the fused
weights and against no LoRA, in eqxdiff and in diffusers with PEFT (unfused and fused; diffusers' unfused / fused is
the reference ratio), all six timed in one run with the same random weights; and the compile count when switching
adapters and strengths and hot-swapping files (0 after the first). Each preset in ``--preset`` in turn.

    python benchmarks/lora_inference.py     # SD 1.5 and SDXL reduced for the CPU (see RESULTS.md for how long)
    python benchmarks/lora_inference.py --preset sd15-reduced --targets all --rank 32   # + feed-forwards, convs
    python benchmarks/lora_inference.py --preset tiny sdxl-tiny --repeats 1 --tolerance 1e-4   # a smoke run
    python benchmarks/lora_inference.py --preset sd15 sdxl --dtype bfloat16 --repeats 20        # on a GPU

The LoRA file is diffusers / PEFT's (``unet.<module>.lora_A.weight`` / ``lora_B.weight``, every tensor random and
non-zero; ``alpha = rank``), read by diffusers' ``load_lora_adapter`` (PEFT layers) and by eqxdiff's loader (the
adapters ``load_lora_weights`` builds, put in the UNet's adapter slots). ``--targets attention`` adapts every
attention's ``to_q / to_k / to_v / to_out.0`` (diffusers' LoRA training default), ``all`` also the feed-forwards,
``proj_in / proj_out``, the ResNets' convolutions and time projections. Six variants take turns (diffusers' one
model switched between them before each timed step, untimed: ``disable_lora``, ``enable_lora``, ``fuse_lora`` /
``unfuse_lora``): each framework without LoRA, unfused, fused. Reported: medians, each framework's overhead
``unfused / fused`` (the adapter path's cost), ``unfused / plain`` and ``fused / plain`` (the same run's medians),
eqxdiff / diffusers per variant, the outputs' agreement (and that the LoRA moves the output: an idle adapter would
time nothing).

The switches run first, on eqxdiff's UNet step under ``eqx.filter_jit`` with JAX's backend-compile events counted (as
``recompile.py`` counts them), the models holding what ``load_lora_weights`` / ``set_adapters`` / ``disable_lora`` /
``load_lora_weights(hotswap=True)`` put in the slots: the first unfused step compiles; a new strength, switching the
adapter off and on, another file of the same ranks and targets, a file of a lower rank padded to the first's
(``max_rank``) compile nothing; the plain and the fused model share one program. Two adapters loaded side by side
compile once (two entries per slot), then switching which is active and at what strength compiles nothing. A file of
another rank without padding is the one that compiles (why ``max_rank`` exists). The timed eqxdiff steps then run
in the programs the switches compiled (as a user's later calls do; their compile count is printed, 0).

The reduced presets keep SD 1.5's and SDXL's widths, heads, block types and conditioning (so each projection's LoRA
costs what it costs at full size, relative to the projection) with one layer per block instead of two, SDXL's
10-layer transformers cut to 2 (as unet_step.py's ``sdxl-small``), and 256x256 images (32x32 latents).
"""

import dataclasses
import gc
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Literal

import numpy as np
import tyro

from _bench import (check_agreement, fmt_seconds, load_average, on_gpu, rel_error, report_cpu_times,
                    report_times, setup_frameworks, torch_sync)
from _unet_configs import PRESETS, UNetBenchmarkArgs, build_models, jax_inputs, jax_step, make_inputs, to_numpy_nhwc
from _unet_configs import torch_inputs as torch_step_inputs
from recompile import Compiles

# SD 1.5's and SDXL's widths, heads, block types and conditioning, one layer per block (not two), 32x32 latents
# (256x256 images); SDXL with sdxl-small's 2 (not 10) transformer layers at the 1280-wide level: the CPU's configs
_REDUCED = dict(layers_per_block=1, sample_size=32)
LORA_PRESETS = {
    "sd15-reduced": dict(PRESETS["sd15"], **_REDUCED),
    "sdxl-reduced": dict(PRESETS["sdxl-small"], **_REDUCED),
    "sd15": PRESETS["sd15"],
    "sdxl-small": PRESETS["sdxl-small"],
    "sdxl": PRESETS["sdxl"],
    "tiny": PRESETS["tiny"],
    "sdxl-tiny": PRESETS["sdxl-tiny"],
}
LoraPreset = Literal["sd15-reduced", "sdxl-reduced", "sd15", "sdxl-small", "sdxl", "tiny", "sdxl-tiny"]
TARGETS = {
    "attention": r"attn[12]\.(to_q|to_k|to_v|to_out\.0)$",
    "all": r"attn[12]\.(to_q|to_k|to_v|to_out\.0)$|ff\.net\.(0\.proj|2)$|proj_(in|out)$|"
           r"resnets\.\d+\.(conv1|conv2|time_emb_proj)$",
}


@dataclasses.dataclass(frozen=True)
class Args(UNetBenchmarkArgs):
    """Time a guided UNet step with a LoRA unfused, fused and without, in eqxdiff and in diffusers + PEFT."""

    preset: tuple[LoraPreset, ...] = ("sd15-reduced", "sdxl-reduced")
    """UNet configs, each in turn: "sd15-reduced" / "sdxl-reduced" (the CPU's: see the module docstring), "sd15"
    (full, 64x64 latents), "sdxl-small" (unet_step.py's reduced SDXL), "sdxl" (full, 128x128 latents), "tiny" /
    "sdxl-tiny" (smoke runs)."""
    rank: int = 16
    """The LoRA's rank."""
    targets: Literal["attention", "all"] = "attention"
    """The layers it adapts: "attention" (to_q, to_k, to_v, to_out.0), "all" (+ feed-forwards, proj_in/out, ResNet
    convolutions and time projections)."""
    guidance_scale: float = 7.5
    """Classifier-free guidance scale."""
    lora_scale: float = 1.0
    """The adapter's strength in the timed steps."""
    tolerance: float | None = None
    """In float32: exit with an error if an eqxdiff output differs from diffusers' by more than this relative
    error; default: only print it."""
    skip_switches: bool = False
    """Leave out the compile count of the switches."""


# -- the LoRA file ----------------------------------------------------------------------------------------------------

def lora_file(ref_unet, path, pattern: str, rank: int, seed: int) -> int:
    """A diffusers / PEFT LoRA file for ``ref_unet``'s layers matching ``pattern``: ``down`` ~ N(0, 1/fan_in),
    ``up`` ~ N(0, 0.25/rank) (the change moves the output without swamping it). Returns the layers adapted."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, m in ref_unet.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and re.search(pattern, name):
            w = m.weight
            fan_in = int(np.prod(w.shape[1:]))
            tensors[f"unet.{name}.lora_A.weight"] = torch.randn(rank, *w.shape[1:], generator=g) / fan_in ** 0.5
            tensors[f"unet.{name}.lora_B.weight"] = (torch.randn(w.shape[0], rank, *(1,) * (w.ndim - 2),
                                                                 generator=g) * 0.5 / rank ** 0.5)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return len(tensors) // 2


def eqxdiff_adapters(unet, path, *, max_rank: int | None = None) -> dict:
    """What ``pipe.load_lora_weights`` puts in the UNet's slots for the file at ``path`` (its SD naming, the
    adapters built on the host): ``{site path: nn.Adapters}`` at strength 1, placed on the device."""
    import jax

    from eqxdiff import nn
    from eqxdiff.loading import lora
    from eqxdiff.pipelines._lora_unet import UNET_NAMINGS

    file = lora.read_lora(path)
    records, unknown = lora.parse(file.tensors)
    matched, unmatched = lora.Matcher({"unet": unet}, UNET_NAMINGS).match(records)
    if unmatched or unknown:
        raise SystemExit(f"{len(unmatched) + len(unknown)} modules of the LoRA file match no eqxdiff layer")
    dtypes = {s: np.dtype(nn.resolve_site(unet, s).weight.dtype) for s in nn.adapter_sites(unet)}
    built = lora.site_adapters(matched, file.peft_config(), dtypes.__getitem__, max_rank=max_rank)["unet"]
    one = np.ones((1,), np.float32)
    return {site.path: jax.device_put(nn.Adapters((adapter,), one, one)) for site, adapter in built.items()}


def with_strength(unet, strength: float, enabled: bool = True):
    """``unet`` with every adapter at ``strength`` (switched off unless ``enabled``): values only, as
    ``set_adapters`` / ``disable_lora`` write them."""
    from eqxdiff import nn

    def change(site, adapters):
        return nn.Adapters(adapters.entries, nn.place_like(np.full((1,), strength, np.float32), adapters.scales),
                           nn.place_like(np.full((1,), float(enabled), np.float32), adapters.enabled))

    return nn.map_adapters(unet, change)


# -- timing -----------------------------------------------------------------------------------------------------------

def time_prepared(variants: Mapping[str, tuple[Callable[[], None], Callable[[], object]]], repeats: int
                  ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, object]]:
    """``_bench.time_interleaved`` with an untimed ``prepare()`` before each timed ``run()`` (diffusers' one model
    switched between its variants): one warm-up each, then ``repeats`` rounds taking turns. Returns wall times,
    process CPU times and each variant's warm-up output."""
    outputs = {}
    for name, (prepare, run) in variants.items():
        prepare()
        outputs[name] = to_numpy_nhwc(run())
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (prepare, run) in variants.items():
            prepare()
            c0, t0 = time.process_time(), time.perf_counter()
            run()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu, outputs


def eqxdiff_step(timestep: int):
    """eqxdiff's guided UNet step as a user's code calls it: ``eqx.filter_jit`` (the weights and adapters are
    arguments; a new structure compiles, new values do not), so the switches and the timed steps share programs."""
    import equinox as eqx

    return eqx.filter_jit(lambda model, *a: jax_step((model, None), *a, timestep=timestep))


def step_arguments(j: dict, args: Args) -> tuple:
    import jax.numpy as jnp

    return j["latents"], j["text"], j["added"], None, jnp.asarray(args.guidance_scale, j["latents"].dtype)


def eqxdiff_variants(step, unet, adapters: dict, j: dict, args: Args) -> dict:
    """eqxdiff's three UNets (plain, unfused at ``lora_scale``, fused: the plain one's structure, so the plain
    program) as runners of ``step``."""
    import jax

    from eqxdiff import nn

    unfused = with_strength(nn.with_adapters(unet, adapters), args.lora_scale)
    models = {"plain": unet, "unfused": unfused, "fused": nn.fuse_adapters(unfused, how="host")}
    step_args = step_arguments(j, args)
    return {f"eqxdiff {label}": (lambda model=model: jax.block_until_ready(step(model, *step_args)))
            for label, model in models.items()}


def diffusers_variants(ref_unet, path, t: dict, args: Args, timestep: int, device) -> dict:
    """diffusers' UNet with the file loaded through PEFT (``load_lora_adapter``), as ``(prepare, run)`` per
    variant: ``disable_lora()`` for plain, ``enable_lora()`` for unfused, ``fuse_lora()`` for fused (unfused again
    after it)."""
    import torch

    ref_unet.load_lora_adapter(str(path), prefix="unet", adapter_name="bench")
    ref_unet.set_adapters(["bench"], [args.lora_scale])
    state = {"fused": False}

    def to(fused: bool, enabled: bool):
        def prepare():
            if state["fused"] and not fused:
                ref_unet.unfuse_lora()
            (ref_unet.enable_lora if enabled else ref_unet.disable_lora)()
            if fused and not state["fused"]:
                ref_unet.fuse_lora(lora_scale=1.0)
            state["fused"] = fused
        return prepare

    def run():
        with torch.no_grad():
            x = torch.cat([t["latents"], t["latents"]])
            eps = ref_unet(x, timestep, t["text"], added_cond_kwargs=t["added_cond_kwargs"]).sample
            uncond, cond = eps.chunk(2)
            out = uncond + args.guidance_scale * (cond - uncond)
        torch_sync(device)
        return out

    return {"diffusers plain": (to(False, False), run), "diffusers unfused": (to(False, True), run),
            "diffusers fused": (to(True, True), run)}


# -- switches ---------------------------------------------------------------------------------------------------------

def side_by_side(first: dict, other: dict, strengths: tuple[float, float], enabled: tuple[bool, bool] = (True, True)
                 ) -> dict:
    """Two files' adapters in each slot (two entries: what loading a second adapter makes), at ``strengths``, each
    switched on or off (``set_adapters([...], [...])`` writes these values)."""
    import jax

    from eqxdiff import nn

    scales, on = np.asarray(strengths, np.float32), np.asarray(enabled, np.float32)
    return {path: nn.Adapters((a.entries[0], other[path].entries[0]), jax.device_put(scales), jax.device_put(on))
            for path, a in first.items()}


def switches(step, unet, paths: Mapping[str, object], j: dict, args: Args, compiles: Compiles
             ) -> list[tuple[str, float, int, bool]]:
    """``(what, seconds, programs compiled, a new structure)`` of eqxdiff's UNet step under ``eqx.filter_jit``
    through a sequence of switches (see the module docstring); ``paths``: the LoRA files (``first``, ``same
    shapes``, ``lower rank``). Only the calls marked as a new structure may compile."""
    import jax

    from eqxdiff import nn

    r, h = args.rank, max(1, args.rank // 2)
    step_args = step_arguments(j, args)
    built = {name: eqxdiff_adapters(unet, paths[name], max_rank=r) for name in ("first", "same shapes", "lower rank")}
    first = nn.with_adapters(unet, built["first"])
    new = {0, 6, 8, 11}  # the calls that bring a new structure: they compile
    calls = [
        (f"first unfused step (rank {r}, padded to max_rank {r})", first),
        ("strength 1.0 -> 0.5 (set_adapters)", with_strength(first, 0.5)),
        ("adapter switched off (disable_lora)", with_strength(first, 0.5, enabled=False)),
        ("switched on again at 1.3 (enable_lora, set_adapters)", with_strength(first, 1.3)),
        ("another file, same ranks and targets (hotswap)", nn.with_adapters(unet, built["same shapes"])),
        (f"a file of rank {h} padded to max_rank {r} (hotswap)", nn.with_adapters(unet, built["lower rank"])),
        ("no LoRA (the plain model: a structure without adapters)", unet),
        ("fused (the plain model's structure)", nn.fuse_adapters(first, how="host")),
        ("two adapters loaded, both active (a new structure: two entries per slot)",
         nn.with_adapters(unet, side_by_side(built["first"], built["same shapes"], (1.0, 1.0)))),
        ("set_adapters(['second'], [0.8]) (switch the active adapter)",
         nn.with_adapters(unet, side_by_side(built["first"], built["same shapes"], (1.0, 0.8), (False, True)))),
        ("set_adapters(['first', 'second'], [0.6, -0.4])",
         nn.with_adapters(unet, side_by_side(built["first"], built["same shapes"], (0.6, -0.4)))),
        (f"a file of rank {h}, not padded (another structure)",
         nn.with_adapters(unet, eqxdiff_adapters(unet, paths["lower rank"]))),
    ]
    rows = []
    for i, (label, model) in enumerate(calls):
        count, t0 = compiles.count, time.perf_counter()
        jax.block_until_ready(step(model, *step_args))
        rows.append((label, time.perf_counter() - t0, compiles.count - count, i in new))
    return rows


# -- the run ----------------------------------------------------------------------------------------------------------

def lora_files(ref_unet, folder: str, args: Args) -> dict[str, str]:
    """The three LoRA files (``first``; ``same shapes``: another of its ranks and targets; ``lower rank``: half its
    rank) for ``ref_unet``, written in ``folder``."""
    paths = {"first": f"{folder}/first.safetensors", "same shapes": f"{folder}/second.safetensors",
             "lower rank": f"{folder}/lower.safetensors"}
    for seed, (name, path) in enumerate(paths.items(), 1):
        rank = max(1, args.rank // 2) if name == "lower rank" else args.rank
        layers = lora_file(ref_unet, path, TARGETS[args.targets], rank, seed=seed)
    print(f"LoRA files: {layers} layers adapted each, ranks {args.rank}, {args.rank} and {max(1, args.rank // 2)}")
    return paths


def run_preset(name: str, args: Args, device, compiles: Compiles) -> dict:
    """Count one preset's switches' compiles, then time its six variants (the eqxdiff ones in the programs the
    switches compiled); returns its summary (medians, errors, switches)."""
    import jax.numpy as jnp
    import torch

    config = LORA_PRESETS[name]
    print(f"\n### {name}: UNet batch={2 * args.batch}, {config['sample_size']}x{config['sample_size']} latents, "
          f"dtype={args.dtype}, LoRA rank={args.rank} targets={args.targets} strength={args.lora_scale}")
    models = build_models(config, args.dtype, device)
    inputs = make_inputs(config, args.batch, args.text_tokens)
    j = jax_inputs(inputs, jnp.dtype(args.dtype))
    step, summary = eqxdiff_step(inputs.timestep), {}
    with tempfile.TemporaryDirectory() as folder:
        paths = lora_files(models.ref_unet, folder, args)
        if not args.skip_switches:
            print(f"switches (eqxdiff, eqx.filter_jit, JAX's backend compiles counted; {load_average()})\n"
                  "| call | wall | programs compiled |\n| --- | ---: | ---: |")
            summary["switches"] = switches(step, models.unet, paths, j, args, compiles)
            for label, seconds, count, _ in summary["switches"]:
                print(f"| {label} | {fmt_seconds(seconds)} | {count} |")
        variants = {k: ((lambda: None), run) for k, run in
                    eqxdiff_variants(step, models.unet, eqxdiff_adapters(models.unet, paths["first"]), j,
                                     args).items()}
        if not args.skip_diffusers:
            torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
            variants.update(diffusers_variants(models.ref_unet, paths["first"], torch_step_inputs(
                inputs, device, torch_dtype), args, inputs.timestep, device))
        print(f"\nbefore timing: {load_average()}")
        count = compiles.count
        wall, cpu, outputs = time_prepared(variants, args.repeats)
        print(f"after timing: {load_average()}; the timed eqxdiff steps compiled {compiles.count - count} programs")
    return {**summary, **report(wall, cpu, outputs, args, device)}


def main(args: Args) -> None:
    device, header = setup_frameworks(args.torch_device, args.tf32)
    print(f"{header}; {load_average()}")
    t0, compiles = time.perf_counter(), Compiles()
    summaries = {}
    for name in args.preset:
        summaries[name] = run_preset(name, args, device, compiles)
        gc.collect()
    print_summary(summaries, args)
    print(f"\ntotal {time.perf_counter() - t0:.0f}s; {load_average()}")


def report(wall, cpu, outputs, args: Args, device) -> dict:
    """Print the medians, each framework's overheads and the agreement; returns ``{variant: median}`` and the
    ratios."""
    med = report_times(wall)
    frameworks = ["eqxdiff"] + ([] if args.skip_diffusers else ["diffusers"])
    if not on_gpu() and device.type == "cpu":
        report_cpu_times(cpu, f"{frameworks[-1]} plain", wall)
    for fw in frameworks:
        plain, unfused, fused = (med[f"{fw} {v}"] for v in ("plain", "unfused", "fused"))
        cpu_ratio = statistics.median(cpu[f"{fw} unfused"]) / statistics.median(cpu[f"{fw} fused"])
        delta = f"{'+-'[unfused < fused]}{fmt_seconds(abs(unfused - fused))}"
        print(f"{fw}: unfused / fused {unfused / fused:.3f} ({delta}; CPU time "
              f"{cpu_ratio:.3f}), unfused / plain {unfused / plain:.3f}, fused / plain {fused / plain:.3f}")
    moved = rel_error(outputs["eqxdiff unfused"], outputs["eqxdiff plain"])
    print(f"the LoRA changes eqxdiff's output by {moved:.2f} relative (unfused against plain); fused against unfused: "
          f"{rel_error(outputs['eqxdiff fused'], outputs['eqxdiff unfused']):.1e}")
    if moved < 1e-3:
        raise SystemExit("the LoRA does not move the output: an idle adapter times nothing")
    if args.skip_diffusers:
        return {"median": med}
    errors = {}
    for variant in ("plain", "unfused", "fused"):
        errors[variant] = rel_error(outputs[f"eqxdiff {variant}"], outputs[f"diffusers {variant}"])
        print(f"ratio eqxdiff/diffusers, {variant}: {med[f'eqxdiff {variant}'] / med[f'diffusers {variant}']:.2f}"
              f"   (outputs agree to relative error {errors[variant]:.1e})")
    check_agreement(errors, args.dtype, args.tolerance)
    return {"median": med, "errors": errors}


def print_summary(summaries: Mapping[str, dict], args: Args) -> None:
    """One Markdown table of every preset's medians and overheads (RESULTS.md's)."""
    frameworks = ["eqxdiff"] + ([] if args.skip_diffusers else ["diffusers"])
    print("\n| preset | framework | no LoRA | unfused | fused | unfused / fused | unfused / plain |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, summary in summaries.items():
        med = summary["median"]
        for fw in frameworks:
            plain, unfused, fused = (med[f"{fw} {v}"] for v in ("plain", "unfused", "fused"))
            print(f"| {name} | {fw} | {fmt_seconds(plain)} | {fmt_seconds(unfused)} | {fmt_seconds(fused)} | "
                  f"{unfused / fused:.3f} | {unfused / plain:.3f} |")
    if args.skip_switches:
        return
    for name, summary in summaries.items():
        rows = summary["switches"]
        values = sum(c for _, _, c, new in rows if not new)
        print(f"{name}: {values} programs compiled by the {sum(not new for *_, new in rows)} switches of values "
              f"(strengths, on / off, hot-swapped files, the active adapter, plain and fused); "
              f"{sum(c for _, _, c, new in rows if new)} by the {sum(new for *_, new in rows)} new structures")


if __name__ == "__main__":
    main(tyro.cli(Args))
