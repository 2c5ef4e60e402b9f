"""The console commands and the entry scripts, run as a user runs them: family options read from the pipeline
class, PNG and MP4 outputs carrying their parameters, numbering and overwrite, errors before loading, a mesh run
equal to one device, train presets, and a wheel installed into a fresh venv."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import typing
from collections.abc import Sequence
from pathlib import Path

import imageio_ffmpeg
import numpy as np
import pytest
import tyro
from PIL import Image

import eqxdiff
from eqxdiff.cli import generate, train
from eqxdiff.cli._options import family_options
from eqxdiff.core import FAMILY_TABLE
from eqxdiff.parallel import MeshConfig, Remat
from eqxdiff.pipelines import Component, DiffusionPipeline, InputError, checked_call, read_parameters, write_video
from eqxdiff.train import FamilyOptions, FluxOptions

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """The shipped digits model (no --model): two runs of the same flags into one folder, then one with another
    seed and --overwrite. One compiled program serves all three."""
    out = tmp_path_factory.mktemp("out")
    argv = ["--steps", "2", "--num-images", "2", "--seed", "7", "--output-dir", str(out), "--no-progress"]
    first = generate.main(argv)
    first_pixels = [np.asarray(Image.open(p)) for p in first]
    second = generate.main(argv)
    third = generate.main([*argv, "--seed", "8", "--overwrite"])
    return out, first, first_pixels, second, third


def test_generate_saves_images_with_parameters_and_prints_timings(tmp_path, capsys):
    paths = generate.main(["--prompt", "a handwritten digit two", "--num-inference-steps", "2",
                           "--num-images-per-prompt", "2", "--seed", "7", "--output-dir", str(tmp_path),
                           "--no-progress"])
    assert [p.name for p in paths] == ["image_0.png", "image_1.png"]
    params = read_parameters(paths[1])
    assert params["prompt"] == "a handwritten digit two" and params["seed"] == 7
    assert params["num_inference_steps"] == 2 and params["num_images_per_prompt"] == 2 and params["index"] == 1
    assert params["model"] == "digits" and params["pipeline"] == "StableDiffusionPipeline"
    # The checkpoint's own scheduler under a name --scheduler accepts; the size used, not None.
    assert params["scheduler"] == "dpm++2m"
    assert (params["height"], params["width"]) == (16, 16)
    assert np.asarray(Image.open(paths[0])).shape == (16, 16, 3)
    captured = capsys.readouterr()
    assert "load:" in captured.err and "compile:" in captured.err and "generation" in captured.err
    assert captured.out.split() == [str(p) for p in paths]


def test_generate_numbers_on_and_overwrites_only_when_asked(digits_runs):
    out, first, first_pixels, second, third = digits_runs
    assert [p.name for p in first] == ["image_0.png", "image_1.png"]
    assert [p.name for p in second] == ["image_2.png", "image_3.png"]
    for before, after in zip(first_pixels, second, strict=True):  # same flags, same images, new names
        np.testing.assert_array_equal(before, np.asarray(Image.open(after)))
    assert [p.name for p in third] == ["image_0.png", "image_1.png"]
    assert sorted(p.name for p in out.iterdir()) == [f"image_{i}.png" for i in range(4)]
    assert read_parameters(third[0])["seed"] == 8 and read_parameters(second[0])["seed"] == 7
    assert not np.array_equal(np.asarray(Image.open(third[0])), first_pixels[0])


def test_scheduler_names_are_what_the_flag_accepts():
    from eqxdiff.schedulers import SCHEDULERS, scheduler_from_config

    raw = {"_class_name": "DDIMScheduler", "beta_schedule": "scaled_linear"}
    for name in SCHEDULERS:
        assert generate.scheduler_name(scheduler_from_config(raw, name=name)) == name
    first_order = scheduler_from_config({**raw, "_class_name": "DPMSolverMultistepScheduler", "solver_order": 1})
    assert generate.scheduler_name(first_order) == "DPMSolverMultistepScheduler"  # no name says order 1


def test_generate_help_lists_the_family_options(capsys):
    with pytest.raises(SystemExit) as e:
        generate.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--prompt", "--num-inference-steps", "--guidance-scale", "--clip-skip", "--strength", "--image",
                 "--model", "--scheduler", "--overwrite", "--mesh.ici-fsdp-parallelism", "StableDiffusionPipeline"):
        assert flag in text, flag
    assert "--latents" not in text and "--prompt-embeds" not in text  # arrays are not flags


def _generate_help(capsys, argv=()) -> str:
    """``eqxdiff-generate --help``'s text on one line (the box's borders and the wrapping gone)."""
    with pytest.raises(SystemExit) as e:
        generate.main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.replace("│", " ").split())


def test_generate_help_lists_debug_and_only_scheduler_names(capsys):
    """--debug, which the description mentions, is a flag of its own with its help (issue 18); --scheduler's choices
    are the scheduler names, without ``None`` (its default: the checkpoint's own scheduler)."""
    from eqxdiff.schedulers import SCHEDULERS

    text = _generate_help(capsys)
    assert re.search(r"--debug Show the full traceback of an error", text), text  # (the description: "--debug shows")
    choices = re.search(r"--scheduler \{([^}]*)\}", text).group(1).replace(" ", "").split(",")
    assert choices == list(SCHEDULERS)
    assert re.search(r"--scheduler \{[^}]*\} Swap .*\(default: the checkpoint's own\)", text)


def test_generate_help_names_the_folders_recommended_values(capsys):
    """--help's "(default: 50)" is the signature's; the digits folder recommends 20 steps, guidance 4 and seed 0
    (model_index.json's call_defaults), which a left-out flag takes: the help says so and lists them."""
    text = _generate_help(capsys)
    assert "(default: 50)" in text  # --num-inference-steps: the signature's, as tyro shows it
    assert ("an option left out takes the --model folder's recommended value first (--num-inference-steps 20, "
            "--guidance-scale 4.0, --seed 0: model_index.json's _eqxdiff.call_defaults)") in text


def test_the_scheduler_option_examples_work_on_the_default_model(capsys):
    """The KEY=VALUE examples of --scheduler-option in --help and in the README are taken by the digits model's
    scheduler (DPM-Solver++): clip_sample=false, the example before, has no meaning there and was refused."""
    text = _generate_help(capsys)
    described = re.search(r"--scheduler-option STR (.*?) \(repeatable\)", text).group(1)
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `--scheduler-op"))
    examples = re.findall(r"\b([a-z_]+=[\w.]+)", described) + re.findall(r"`([a-z_]+=[^`]+)`", row)
    assert len(examples) >= 4, examples
    for example in examples:
        checked = generate.validate(["--scheduler-option", example])
        assert example.split("=")[0] in checked.scheduler_options


def test_a_short_form_and_its_long_form_may_repeat_a_value():
    checked = generate.validate(["--steps", "3", "--num-inference-steps=3", "--num-images", "2",
                                 "--num-images-per-prompt", "2"])
    assert checked.kwargs["num_inference_steps"] == 3 and checked.kwargs["num_images_per_prompt"] == 2


def test_the_folders_recommended_call_is_what_the_command_runs(tmp_path, monkeypatch):
    """Without --steps, --guidance-scale and --seed, eqxdiff-generate makes the digits folder's recommended call
    (model_index.json's ``_eqxdiff.call_defaults``: 20 steps, guidance 4, seed 0) and its PNG records those values;
    a flag given wins, even one that repeats the signature's default (issue 18). The denoising loop is a stand-in
    that notes what it was asked to run (its noise is decoded as it is): nothing of it compiles."""
    from eqxdiff.pipelines import _latents

    asked = []

    def loop(self, denoiser, scheduler, state, latents, cond, key, *, guidance, num_steps, progress):
        asked.append((num_steps, float(guidance.scale), np.asarray(latents)))
        return latents

    monkeypatch.setattr(_latents.LatentPipeline, "run_loop", loop)
    runs = {"folder's": [], "explicit": ["--steps", "20", "--guidance-scale", "4", "--seed", "0"],
            "given": ["--num-inference-steps", "50", "--guidance-scale", "7.5", "--seed", "5"]}
    recorded = {}
    for name, flags in runs.items():
        paths = generate.main(["--prompt", "a handwritten digit two", *flags, "--output-dir", str(tmp_path / name),
                               "--no-progress"])
        params = read_parameters(paths[0])
        recorded[name] = (params["num_inference_steps"], params["guidance_scale"], params["seed"])
    assert recorded == {"folder's": (20, 4.0, 0), "explicit": (20, 4.0, 0), "given": (50, 7.5, 5)}
    folder, explicit, given = asked
    assert folder[:2] == explicit[:2] == (20, 4.0) and given[:2] == (50, 7.5)
    np.testing.assert_array_equal(folder[2], explicit[2])  # seed 0's noise
    assert not np.array_equal(folder[2], given[2])


def test_loading_without_pytorch_prints_no_transformers_notice():
    """Without PyTorch (eqxdiff's users need none), importing transformers for the tokenizers printed "PyTorch was
    not found. Models won't be available ..." on every run (issue 18). Loading the digits pipeline and building the
    training's character tokenizer print nothing of it (the digits pipeline no longer imports transformers at all:
    its tokenizer is read with ``tokenizers``); the user's environment and transformers' warnings stay as they were."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    for first, imports in (("eqxdiff.load_pipeline('digits')", "False"), ("eqxdiff.data.character_tokenizer()", "True")):
        code = ("import sys; sys.modules['torch'] = None\n"
                f"import os, eqxdiff, eqxdiff.data\n{first}\n"
                "imported = 'transformers' in sys.modules\n"
                "verbosity = sys.modules['transformers'].logging.get_verbosity() if imported else 30\n"
                "print(imported, os.environ.get('TRANSFORMERS_NO_ADVISORY_WARNINGS'), verbosity)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                             env={**env, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr[-2000:]
        assert "PyTorch was not found" not in out.stderr + out.stdout, (first, out.stderr[-2000:])
        # whether eqxdiff imported transformers; the variable unset again; transformers warns as before
        assert out.stdout.split()[-3:] == [imports, "None", "30"], (first, out.stdout)


def test_generate_cli_rejects_bad_flags():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--weights-dtype", "int8"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode != 0 and "weights-dtype" in (out.stderr + out.stdout)


def test_generate_missing_model_says_so(tmp_path):
    with pytest.raises(eqxdiff.CheckpointError, match="does not exist"):
        generate.main(["--model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "out")])


def test_generate_unknown_family_lists_what_eqxdiff_serves(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideoPipeline"}))
    with pytest.raises(eqxdiff.CheckpointError, match="HunyuanVideoPipeline.*serves.*StableDiffusionPipeline"):
        generate.main(["--model", str(tmp_path)])


def test_generate_bad_output_path_or_input_file_fails_before_loading(tmp_path):
    # A Stable Diffusion index without its components: loading it would fail with "lacks component(s)".
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    (tmp_path / "taken").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        generate.main(["--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "taken")])
    with pytest.raises(FileNotFoundError, match="--image .*missing.png'?: no such file"):
        generate.main(["--model", str(tmp_path / "model"), "--image", str(tmp_path / "missing.png")])


# -- a family the script has never heard of: a video pipeline declared only by its __call__ -----------------------

class ToyVideoPipeline(DiffusionPipeline):
    """A stand-in video family with no model: each frame's brightness ramps with time."""

    CLASS_NAME = "ToyVideoPipeline"
    COMPONENTS = (Component("scheduler", "diffusers", "scheduler"),)
    meshes: typing.ClassVar[list] = []  # the mesh of every call, for the tests

    @checked_call
    def __call__(self, prompt: str | Sequence[str] | None = None, *, num_frames: int = 5, height: int = 32,
                 width: int = 32, frame_rate: int = 8, brightness: float = 0.5, seed: int = 0, latents=None,
                 video=None, progress: bool = True) -> np.ndarray:
        """Frames ``[1, F, H, W, 3]``.

        Args:
            num_frames: Frames in the toy video.
            brightness: Where the ramp starts, 0 to 1.
        """
        if prompt is None:
            raise ValueError("pass prompt")
        self.meshes.append(self.mesh)
        start = 255 * brightness if video is None else float(np.mean(video))
        ramp = np.linspace(start, start + 60, num_frames)[:, None, None, None]
        return np.broadcast_to(ramp, (1, num_frames, height, width, 3)).astype(np.uint8)


@pytest.fixture
def toy_video_model(tmp_path, monkeypatch):
    monkeypatch.setitem(FAMILY_TABLE, "ToyVideoPipeline", f"{__name__}:ToyVideoPipeline")
    folder = tmp_path / "toy"
    (folder / "scheduler").mkdir(parents=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "DDIMScheduler"}))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "ToyVideoPipeline",
                                                         "scheduler": ["diffusers", "DDIMScheduler"]}))
    return folder


def test_a_new_family_gets_its_options_and_mp4_output(toy_video_model, tmp_path, capsys):
    with pytest.raises(SystemExit):
        generate.main(["--model", str(toy_video_model), "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--num-frames" in text and "Frames in the toy video." in text  # help from the docstring
    assert "--frame-rate" in text and "--video" in text and "--latents" not in text

    out = tmp_path / "out"
    paths = generate.main(["--model", str(toy_video_model), "--prompt", "a ramp", "--num-frames", "9",
                           "--brightness", "0.2", "--width", "48", "--output-dir", str(out)])
    assert [p.name for p in paths] == ["video_0.mp4"]
    params = read_parameters(paths[0])
    assert params["prompt"] == "a ramp" and params["num_frames"] == 9 and params["fps"] == 8  # fps = frame_rate
    assert (params["height"], params["width"]) == (32, 48) and params["scheduler"] == "ddim"
    frames = _read_frames(paths[0])
    assert frames.shape == (9, 32, 48, 3)
    np.testing.assert_allclose(frames.mean(axis=(1, 2, 3)), np.linspace(51, 111, 9).astype(np.uint8), atol=3)

    # A video input flag reads the file: the ramp now starts at the input video's mean brightness.
    again = generate.main(["--model", str(toy_video_model), "--prompt", "a ramp", "--video", str(paths[0]),
                           "--num-frames", "3", "--fps", "4", "--output-dir", str(out)])
    assert [p.name for p in again] == ["video_1.mp4"]
    assert read_parameters(again[0])["video"] == str(paths[0]) and read_parameters(again[0])["fps"] == 4
    assert abs(_read_frames(again[0])[0].mean() - frames.mean()) < 3


def test_mesh_flags_reach_the_pipeline(toy_video_model, tmp_path):
    """--mesh.* (or --parallel) loads the pipeline onto a mesh of the 8 simulated devices; without them, none."""
    toy = ["--model", str(toy_video_model), "--prompt", "x", "--num-frames", "2", "--output-dir", str(tmp_path)]
    ToyVideoPipeline.meshes.clear()
    generate.main(toy)
    generate.main([*toy, "--mesh.ici-data-parallelism", "1", "--mesh.ici-fsdp-parallelism", "-1"])
    generate.main([*toy, "--parallel"])
    plain, fsdp, data = ToyVideoPipeline.meshes
    assert plain is None
    assert dict(fsdp.shape) == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    assert dict(data.shape) == {"data": 8, "fsdp": 1, "context": 1, "tensor": 1}
    with pytest.raises(ValueError, match="process_id"):  # multi-host settings come as a set
        generate.main([*toy, "--num-processes", "2"])


class _InlineDocumented(DiffusionPipeline):
    CLASS_NAME = "InlineDocumented"
    COMPONENTS = ()

    @checked_call
    def __call__(self, prompt: str = "x", *, eta: float = 0.0, timesteps: Sequence[int] | None = None,
                 mask_image=None, key=None, output_type: str = "uint8"):
        """Images.

        ``eta``: DDIM's noise. ``timesteps`` (descending): a custom schedule instead of
        ``num_inference_steps``. Not part of it.
        ``mask_image`` (white = repaint): inpainting.
        """


def test_family_options_read_types_and_inline_docstrings():
    family = family_options(_InlineDocumented)
    fields = {f.name: typing.get_args(f.type) for f in dataclasses.fields(family.options)}
    assert list(fields) == ["prompt", "eta", "timesteps", "mask_image"]  # no key, no output_type
    assert fields["timesteps"][0] == tuple[int, ...] | None and fields["mask_image"][0] == Path | None
    helps = {name: args[1].help for name, args in fields.items()}
    assert helps["eta"] == "eta: DDIM's noise."
    assert helps["timesteps"] == "timesteps (descending): a custom schedule instead of num_inference_steps."
    assert helps["mask_image"].endswith("mask_image (white = repaint): inpainting.")  # after "a mask image file"
    assert family.media == {"mask_image": "mask"}  # read in grayscale, as diffusers reads masks


def _read_frames(path) -> np.ndarray:
    reader = imageio_ffmpeg.read_frames(str(path))
    width, height = next(reader)["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader])


def test_mp4_writer_round_trip(tmp_path):
    """9 synthetic 32x32 frames through write_video, read back with imageio-ffmpeg."""
    y, x = np.mgrid[0:32, 0:32]
    frames = np.stack([np.stack([(x * 8 + 10 * t) % 256, y * 8, np.full_like(x, 25 * t)], axis=-1)
                       for t in range(9)]).astype(np.uint8)
    params = {"prompt": 'quotes " and = ; # \\ backslash', "num_frames": 9, "seed": None}
    path = write_video(frames, tmp_path / "clip.mp4", fps=12, parameters=params)
    back = _read_frames(path)
    assert back.shape == (9, 32, 32, 3)
    assert np.abs(back.astype(int) - frames).mean() < 6  # lossy H.264 in yuv420p: loosely the same pixels
    assert read_parameters(path) == params
    with pytest.raises(ValueError, match="uint8"):
        write_video(frames.astype(np.float32), tmp_path / "bad.mp4")


# -- train ---------------------------------------------------------------------------------------------------------

def test_train_exports_under_the_output_dir_unless_told():
    config = train.parse(["digits", "--steps", "20", "--output-dir", "/somewhere/else"])
    assert config.steps == 20 and config.output_dir == Path("/somewhere/else")
    for name, (_, preset) in train.PRESETS.items():
        assert preset.export_dir is None, f"preset {name} exports to {preset.export_dir}"
    assert train.parse(["digits", "--export-dir", "mine"]).export_dir == Path("mine")


def test_train_rejects_conflicting_sources():
    with pytest.raises(ValueError, match="give one data source"):  # raised, for eqxdiff-train's one-line error
        train.parse(["digits", "--data", "folder", "--hf-dataset", "user/name"])


# What tests/test_train_sdxl.py and tests/test_train_flux.py train with: FSDP over every device, full remat, the
# stream's latents and text embeddings cached (frozen text encoders), the folder's own scheduler exported.
LARGE_PRESETS = {
    "sdxl": dict(model="stabilityai/stable-diffusion-xl-base-1.0", resolution=1024, family=FamilyOptions()),
    "flux-dev": dict(model="black-forest-labs/FLUX.1-dev", resolution=512,
                     family=FluxOptions(guidance_scale=3.5, max_sequence_length=512), sample_guidance_scale=3.5),
    "flux-schnell": dict(model="black-forest-labs/FLUX.1-schnell", resolution=512,
                         family=FluxOptions(max_sequence_length=256), sample_guidance_scale=0.0, sample_steps=4),
}


@pytest.mark.parametrize("preset", list(LARGE_PRESETS))
def test_large_presets_train_as_their_family_tests_do(preset, tmp_path, monkeypatch):
    config = train.parse([preset])
    assert config.mesh == MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1)
    assert config.remat is Remat.FULL and config.remat_names == ()
    assert config.cache and config.cache_stream and not config.train_text_encoder
    assert config.export_scheduler is None and config.export_dir is None
    assert config.optimizer.total_steps is None and config.objective.weighting_scheme == "none"  # spans --steps
    for key, value in LARGE_PRESETS[preset].items():
        assert getattr(config, key) == value, (preset, key)
    monkeypatch.chdir(tmp_path)  # the checks before loading accept it (a Hub model is not fetched by them)
    assert train.validate([preset, "--data", str(tmp_path)]) == dataclasses.replace(config, data=str(tmp_path))


def test_family_options_are_flags_of_their_presets(capsys):
    """A family's own options are ``--family.*`` flags of its presets, named in their errors; the top-level flags
    they were before (``--guidance-scale``, ``--max-sequence-length``) still set them, with a note; under a preset
    whose family lacks them, the error names the presets that take them."""
    config = train.parse(["flux-dev", "--family.guidance-scale", "2.5", "--family.max-sequence-length=128"])
    assert config.family == FluxOptions(guidance_scale=2.5, max_sequence_length=128)
    capsys.readouterr()
    assert train.parse(["flux-schnell", "--guidance-scale", "4", "--max-sequence-length=64", "--steps", "3"]) == \
        dataclasses.replace(train.PRESETS["flux-schnell"][1], steps=3, family=FluxOptions(4.0, 64))
    assert capsys.readouterr().err.splitlines() == [
        "note: --guidance-scale is --family.guidance-scale now (the old name still works)",
        "note: --max-sequence-length is --family.max-sequence-length now (the old name still works)"]
    with pytest.raises(ValueError, match=r"^--family.max-sequence-length 513 must be in \[1, 512\]"):
        train.parse(["flux-dev", "--family.max-sequence-length", "513"])
    with pytest.raises(ValueError, match=r"^--family.guidance-scale nan must be finite$"):
        train.parse(["flux-dev", "--max-sequence-length", "8", "--guidance-scale", "nan"])
    with pytest.raises(train.FlagError, match=r"^--guidance-scale \(--family.guidance-scale now\) is a family "
                       r"option of the flux-dev, flux-schnell, lora-flux and dreambooth-flux presets; the sd15 "
                       r"preset's family takes none$"):
        train.parse(["sd15", "--guidance-scale", "3"])
    with pytest.raises(train.FlagError, match=r"^--family.max-sequence-length is a family option of the flux-dev, "
                       r"flux-schnell, lora-flux, dreambooth-flux, wan2.1-1.3b, wan2.1-14b, wan2.2-a14b and "
                       r"wan2.2-ti2v-5b presets; the sdxl preset's family takes none$"):
        train.parse(["sdxl", "--family.max-sequence-length", "77"])
    assert train.field_flags(train.PRESETS["flux-dev"][1])["max_sequence_length"] == "--family.max-sequence-length"
    assert "max_sequence_length" not in train.FIELD_FLAGS and "guidance_scale" not in train.FIELD_FLAGS


def test_a_model_of_another_family_than_the_preset_is_refused_before_loading(tmp_path, monkeypatch):
    """A local --model folder is checked against the preset before anything loads: a pipeline eqxdiff does not
    train, or (flux-dev) Flux options given to an SDXL folder, are one-line errors naming the fix."""
    monkeypatch.setattr(train, "run", lambda config: pytest.fail("loaded"))
    for name in ("sdxl", "kontext"):
        (tmp_path / name / "vae").mkdir(parents=True)
        (tmp_path / name / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [8, 8]}))
    (tmp_path / "sdxl" / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    (tmp_path / "kontext" / "model_index.json").write_text(json.dumps({"_class_name": "FluxKontextPipeline"}))
    data = ["--data", str(tmp_path), "--output-dir", str(tmp_path / "run"), "--resolution", "16"]
    with pytest.raises(InputError, match=r"--model '.*sdxl' is a StableDiffusionXLPipeline, which trains as "
                       r"SDXLLatentDiffusion, but the preset's --family.\* options are FluxOptions, another family's; "
                       r"start from a preset of the model's family \(digits, sd15, sd21, sdxl, lora-digits, lora-sd15, "
                       r"lora-sdxl, dreambooth-sd15, dreambooth-sdxl\) with --model"):
        train.main(["flux-dev", "--model", str(tmp_path / "sdxl"), *data])
    with pytest.raises(ValueError, match=r"eqxdiff does not fine-tune a FluxKontextPipeline"):
        train.main(["flux-dev", "--model", str(tmp_path / "kontext"), *data])
    config = train.validate(["sdxl", "--model", str(tmp_path / "sdxl"), *data])
    assert config.family == FamilyOptions()


def _help_entries(text: str) -> dict[str, str]:
    """``{flag: its help text}`` from tyro's ``--help`` (box or plain layout; the help beside the flag or on the
    lines under it)."""
    entries, flag = {}, None
    for line in text.splitlines():
        content = line.strip("\u2502").rstrip()  # the box's side borders, if drawn
        found = re.match(r" {0,3}(-{1,2}[\w][\w.-]*)", content)
        if found:
            flag = found.group(1)
            parts = re.split(r"\s{2,}", content.strip(), maxsplit=1)
            entries[flag] = parts[1] if len(parts) > 1 else ""
        elif flag is not None and re.match(r" {4,}\S", content):
            entries[flag] += " " + content.strip()
        else:
            flag = None
    return entries


def _help_text(entry: str) -> str:
    return re.sub(r"\s*\((?:default: .*|required|fixed.*)\)$", "", entry).strip()


@dataclasses.dataclass(frozen=True)
class _HalfDocumented:
    documented: int = 1
    """Has a help text."""
    undocumented: int = 2


@pytest.mark.parametrize("preset", list(train.PRESETS))
def test_every_train_flag_has_help(preset, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):  # the parser reads an undocumented field as an empty help
        tyro.cli(_HalfDocumented, args=["--help"])
    probe = {k: _help_text(v) for k, v in _help_entries(capsys.readouterr().out).items()}
    assert probe["--documented"] == "Has a help text." and probe["--undocumented"] == ""
    with pytest.raises(SystemExit) as info:
        train.parse([preset, "--help"])
    assert info.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    flags = set(train.field_flags(train.PRESETS[preset][1]).values())  # with the family's --family.* options
    assert set(train.FIELD_FLAGS.values()) <= flags and flags <= set(entries), sorted(flags - set(entries))
    undocumented = sorted(flag for flag, entry in entries.items() if not _help_text(entry))
    assert not undocumented, f"eqxdiff-train {preset} --help: no help for {undocumented}"


def test_the_schedule_follows_steps_unless_total_steps_is_given(tmp_path, capsys, monkeypatch):
    """No preset fixes the schedule's length: ``digits --steps 30`` decays its learning rate over 30 steps, with no
    note (it once said ``optimizer.total_steps=1500 differs from steps=30`` of a value the user never set); an
    explicit ``--optimizer.total-steps`` that differs from ``--steps`` is kept, with a note."""
    runs = []
    monkeypatch.setattr(train, "run", runs.append)
    for preset, (_, config) in train.PRESETS.items():
        assert config.optimizer.total_steps is None, preset
    out = ["--output-dir", str(tmp_path)]
    train.main(["digits", "--steps", "30", *out])
    assert capsys.readouterr().err == "" and runs[-1].resolved().optimizer.total_steps == 30
    assert eqxdiff.train.make_optimizer(runs[-1].resolved().optimizer).config.update_steps == 30
    train.main(["digits", "--steps", "30", "--optimizer.total-steps", "100", *out])
    assert capsys.readouterr().err == ("note: --optimizer.total-steps 100 differs from --steps 30: the learning-rate "
                                       "schedule spans 100 steps\n")
    assert runs[-1].resolved().optimizer.total_steps == 100
    with pytest.raises(ValueError, match=r"total_steps=None leaves the schedule's length to the run"):
        eqxdiff.train.make_optimizer(eqxdiff.train.OptimizerConfig())


def test_train_help_says_what_may_change_on_resume_and_when_the_autoencoder_stage_runs(capsys, monkeypatch):
    """``--help`` lists the settings a resumed run may change (each one :data:`RESUMABLE` holds), and says that the
    digits preset's autoencoder stage runs before any of ``--steps``, with its own progress bar."""
    from eqxdiff.train._config import RESUMABLE

    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        train.parse(["digits", "--help"])
    text = capsys.readouterr().out
    resume = " ".join(_help_entries(text)["--resume"].split())
    listed = set(re.findall(r"[\w.]*\w", resume.split("may differ from the ones it was saved with", 1)[1]))
    assert set(RESUMABLE) - {"output_dir", "resume"} <= listed, sorted(set(RESUMABLE) - listed)
    digits = " ".join(text.split())
    assert "Its autoencoder stage (--autoencoder-steps 600, about 3 minutes on a 2-core CPU, its own progress bar) " \
           "trains the VAE before any of --steps, whatever --steps is" in digits, digits[:600]


def test_a_numeric_flag_names_itself_in_its_error():
    """``number_error`` (what both commands call once tyro refused a command line) names the first numeric flag
    whose value does not convert and what it takes, for dotted (eqxdiff-train's) and flat flags, ``--flag=value``,
    negative numbers, ``None`` for an optional one and a sequence's values; any other line gives ``None``."""
    from eqxdiff.cli._numbers import field_types, number_error

    @dataclasses.dataclass(frozen=True)
    class Inner:
        rate: float = 0.1

    @dataclasses.dataclass(frozen=True)
    class Flags:
        steps: int = 1
        seed: int | None = None
        sizes: tuple[int, ...] = ()
        name: str = ""
        flag: bool = False
        inner: Inner = Inner()

    dotted = {"--" + k.replace("_", "-"): v for k, v in field_types(Flags).items()}
    flat = {"--" + k: v for k, v in field_types(Flags, dotted=False).items()}
    assert sorted(dotted) == ["--flag", "--inner.rate", "--name", "--seed", "--sizes", "--steps"]
    assert "--rate" in flat and "--inner.rate" not in flat
    assert number_error(["--steps", "-3", "--seed", "None", "--sizes", "1", "-2", "--inner.rate=1e-3", "--name",
                         "x", "--flag"], dotted) is None
    assert number_error(["--steps", "abc"], dotted) == "--steps expects an integer, got 'abc'"
    assert number_error(["--steps", "5", "extra"], dotted) is None  # a stray word is not the flag's
    assert number_error(["--seed=1.5"], dotted) == "--seed expects an integer or None, got '1.5'"
    assert number_error(["--sizes", "1", "two", "--flag"], dotted) == "--sizes expects integers, got 'two'"
    assert number_error(["--inner.rate", "fast"], dotted) == "--inner.rate expects a number, got 'fast'"
    assert number_error(["--rate", "fast"], flat) == "--rate expects a number, got 'fast'"


# -- a wheel is a complete install ---------------------------------------------------------------------------------

def test_wheel_installs_the_commands_and_the_digits_model(tmp_path):
    """``pip wheel`` of the checkout, installed alone into a fresh venv (dependencies from this venv by a .pth, the
    editable eqxdiff invisible): a bare ``eqxdiff-generate`` run from an empty folder draws with the shipped model."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "eqxdiff", src / "eqxdiff", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")],
                   check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("eqxdiff-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "_outer_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "empty"
    work.mkdir()
    where = subprocess.run([str(python), "-c", "import eqxdiff; print(eqxdiff.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(venv), f"eqxdiff imported from {where}, not the wheel"

    out = subprocess.run([str(venv / "bin" / "eqxdiff-generate"), "--steps", "2", "--no-progress",
                          "--compilation-cache-dir", "cache"], cwd=work, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    image = work / "outputs" / "image_0.png"
    assert out.stdout.split() == ["outputs/image_0.png"]
    pixels = np.asarray(Image.open(image))
    assert pixels.shape == (16, 16, 3) and pixels.std() > 10  # strokes, not a flat image
    params = read_parameters(image)
    assert params["model"] == "digits" and params["prompt"] == "a handwritten digit seven"
    assert params["scheduler"] == "dpm++2m" and params["num_inference_steps"] == 2
    assert any((work / "cache").iterdir())

    helped = subprocess.run([str(venv / "bin" / "eqxdiff-train"), "digits", "--help"], cwd=work, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert helped.returncode == 0 and "--export-dir" in helped.stdout
