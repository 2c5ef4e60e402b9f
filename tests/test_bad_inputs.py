"""Every bad input a user can make gets a clear, typed, one-line error before anything loads or compiles, and
nothing on disk changes: one table of cases across ``eqxdiff-generate``, ``eqxdiff-train`` and the Python API.

A command-line case runs twice: ``validate`` (the check before loading) must raise the error type with the message,
and the console command itself (``cli()``, through ``run_command``) must print exactly one ``error: ...`` line and
exit with status 2. Every case snapshots the workspace (an output folder with an image in it, a saved model, the
shipped digits model, the current folder) before and after and requires them equal. The few behaviours that need a
compiled program (what a PNG records, NaN out of a model) share one program at the end.
"""

import copy
import dataclasses
import errno
import json
import os
import re
import shutil
import sys
import tempfile
import types
import warnings
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from PIL import Image

import eqxdiff
from eqxdiff.cli import _command, generate, train
from eqxdiff.core import ConfigError
from eqxdiff.loading import PACKAGED_MODELS, CheckpointError
from eqxdiff.loading import _checkpoint as checkpoint_module
from eqxdiff.parallel import MeshError
from eqxdiff.pipelines import (
    CallLimits,
    InputError,
    InputTypeError,
    InputWarning,
    NonFiniteError,
    StableDiffusionXLPipeline,
    read_image,
    read_parameters,
    seed_key,
)
from eqxdiff.pipelines._checks import check_finite_output
from eqxdiff.train import CheckpointMismatchError, DataError, TrainingInterrupted

from .test_lora_cli import digits_lora, flux_lora

DIGITS = PACKAGED_MODELS["digits"]


# -- the workspace every case must leave as it was --------------------------------------------------------------

@pytest.fixture(scope="module")
def pipe():
    return eqxdiff.load_pipeline("digits")


@pytest.fixture(scope="module")
def ws(tmp_path_factory, pipe):
    root = tmp_path_factory.mktemp("workspace")
    (root / "cwd").mkdir()
    (root / "out").mkdir()
    Image.fromarray(np.full((16, 16, 3), 7, np.uint8)).save(root / "out" / "image_0.png")
    Image.fromarray(np.zeros((18, 18, 3), np.uint8)).save(root / "odd.png")
    Image.fromarray(np.zeros((23, 17, 3), np.uint8)).save(root / "tall.png")  # width 17, height 23
    Image.fromarray(np.full((16, 16, 3), 200, np.uint8)).save(root / "square.png")
    (root / "taken").write_text("a file where a folder should be")
    (root / "notes.png").write_text("not an image")
    (root / "unknown").mkdir()
    (root / "unknown" / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideoPipeline"}))
    (root / "flux").mkdir()  # a pipeline without a UNet (checked before its configs are read)
    (root / "flux" / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (root / "unet.ckpt").write_bytes(b"a pickle")
    (root / "cut.safetensors").write_bytes(b"\x10\x00")
    (root / "broken").mkdir()
    (root / "broken" / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline",')
    digits_lora(root / "lora.safetensors", pipe)  # LoRA files: one for the digits model, rank 2
    digits_lora(root / "partly_lora.safetensors", pipe, extra={"lora_unet_nowhere.lora_down.weight":
                                                               np.ones((2, 4), np.float32),
                                                               "lora_unet_nowhere.lora_up.weight":
                                                               np.ones((4, 2), np.float32)})
    flux_lora(root / "flux_lora.safetensors")
    eqxdiff.save_pretrained(pipe.vae, root / "saved_vae")
    (root / "saved_vae" / "README.md").write_text("my notes")
    eqxdiff.save_pipeline(pipe, root / "saved_pipe")
    (root / "saved_pipe" / "safety_checker").mkdir()
    (root / "saved_pipe" / "safety_checker" / "keep.txt").write_text("not eqxdiff's")
    _interrupted_run(root / "run")
    (root / "trained").mkdir()  # a training run's output folder: its pipeline is in pipeline/
    shutil.copytree(root / "saved_pipe", root / "trained" / "pipeline")
    paths = {p.stem if p.is_file() else p.name: str(p) for p in root.iterdir()}
    return types.SimpleNamespace(root=root, paths=paths)


# The run the resume rows continue: `eqxdiff-train digits --steps 200 --optimizer.learning-rate 0.001` stopped at
# step 55 (its checkpoint holds a stand-in state: only the settings saved with it are read before loading).
RUN_FLAGS = ["--steps", "200", "--optimizer.learning-rate", "0.001"]


def _interrupted_run(folder):
    from eqxdiff.train import Checkpointer
    from eqxdiff.train._config import run_settings

    config = train.validate(["digits", "--output-dir", str(folder), *RUN_FLAGS])
    checkpointer = Checkpointer(folder / "checkpoints", every=0, settings=run_settings(config))
    checkpointer.save(55, {"x": np.zeros(2, np.float32)})
    checkpointer.close()


def snapshot(*folders) -> dict:
    """Every file under ``folders``: size, modification time and (small files) contents."""
    out = {}
    for folder in folders:
        for p in sorted(Path(folder).rglob("*")):
            st = p.lstat()
            out[str(p)] = (p.is_dir(), st.st_size, st.st_mtime_ns,
                           p.read_bytes() if p.is_file() and st.st_size < 4096 else None)
    return out


@pytest.fixture
def unchanged(ws, monkeypatch):
    """Run the test in the workspace's empty current folder; afterwards nothing on disk may differ."""
    monkeypatch.chdir(ws.root / "cwd")
    before = snapshot(ws.root, DIGITS)
    yield
    after = snapshot(ws.root, DIGITS)
    assert after == before, f"changed on disk: {sorted(set(after.items()) ^ set(before.items()))[:4]}"


def one_line(message: str) -> None:
    assert "\n" not in message and message.strip() == message, f"not one line: {message!r}"


# -- the table: command lines ------------------------------------------------------------------------------------

# (id, argv with {workspace names}, error type, message pattern)
GENERATE = [
    ("height-zero", ["--height", "0"], InputError, r"--height 0 must be a positive multiple of 4; leave --height "
     r"unset for the model's native size \(16 px\)"),
    ("height-negative", ["--height", "-16"], InputError, r"--height -16 must be a positive multiple of 4"),
    ("width-not-multiple", ["--width", "18"], InputError, r"--width 18 must be a multiple of 4 \(the VAE downsamples "
     r"by 4\); try --width 16"),
    ("guidance-nan", ["--guidance-scale", "nan"], InputError, r"--guidance-scale nan: pass a finite scale \(7.5 is "
     r"usual; 1 or less turns guidance off\)"),
    ("guidance-inf", ["--guidance-scale", "inf"], InputError, r"--guidance-scale inf: pass a finite scale"),
    ("guidance-minus-inf", ["--guidance-scale", "-inf"], InputError, r"--guidance-scale -inf: pass a finite scale"),
    ("clip-skip-negative", ["--clip-skip", "-1"], InputError, r"--clip-skip -1: the text encoder has layers for "
     r"--clip-skip 0 to 2; pass one of those"),
    ("clip-skip-too-deep", ["--clip-skip", "5"], InputError, r"--clip-skip 5: .*0 to 2"),
    ("strength-without-image", ["--strength", "0.5"], InputError, r"--strength 0.5 applies to image-to-image only; "
     r"pass --image"),
    ("strength-out-of-range", ["--image", "{odd}", "--strength", "1.5"], InputError,
     r"--strength must be in \(0, 1\], got 1.5"),
    ("mask-without-image", ["--mask-image", "{odd}"], InputError, r"--mask-image needs --image"),
    ("zero-steps", ["--steps", "0"], InputError, r"--num-inference-steps 0 must be >= 1"),
    # issue 18: a short form and its long form given together: the last one silently won
    ("short-and-long-forms-disagree", ["--num-images", "2", "--num-images-per-prompt", "3"], _command.FlagError,
     r"^--num-images 2 and --num-images-per-prompt 3 disagree \(--num-images is short for --num-images-per-prompt\); "
     r"give one of them$"),
    ("long-and-short-forms-disagree", ["--num-inference-steps=4", "--steps", "5"], _command.FlagError,
     r"^--num-inference-steps 4 and --steps 5 disagree \(--steps is short for --num-inference-steps\)"),
    ("mask-forms-disagree", ["--image", "{square}", "--mask", "{square}", "--mask-image", "{odd}"],
     _command.FlagError, r"^--mask .*square.png and --mask-image .*odd.png disagree"),
    # issue 18: a value that does not parse named neither the flag nor what it takes
    ("steps-a-word", ["--steps", "abc"], _command.FlagError, r"^--steps expects an integer, got 'abc'$"),
    ("steps-nan", ["--steps", "nan"], _command.FlagError, r"^--steps expects an integer, got 'nan'$"),
    ("steps-a-fraction", ["--num-inference-steps=2.5"], _command.FlagError, r"^--num-inference-steps expects an "
     r"integer, got '2.5'$"),
    ("guidance-a-word", ["--guidance-scale", "high"], _command.FlagError, r"^--guidance-scale expects a number, got "
     r"'high'$"),
    ("height-a-word", ["--height", "tall"], _command.FlagError, r"^--height expects an integer or None, got 'tall'$"),
    ("timesteps-a-word", ["--timesteps", "999", "x"], _command.FlagError, r"^--timesteps expects integers or None, "
     r"got 'x'$"),
    ("fps-a-word", ["--fps", "fast"], _command.FlagError, r"^--fps expects a number or None, got 'fast'$"),
    ("processes-a-word", ["--num-processes", "two"], _command.FlagError, r"^--num-processes expects an integer or "
     r"None, got 'two'$"),
    ("mesh-a-word", ["--mesh.ici-fsdp-parallelism", "two"], _command.FlagError, r"^--mesh.ici-fsdp-parallelism "
     r"expects an integer, got 'two'$"),
    ("zero-images", ["--num-images", "0"], InputError, r"--num-images-per-prompt 0 must be >= 1"),
    ("rescale-above-one", ["--guidance-rescale", "1.5"], InputError,
     r"--guidance-rescale must be in \[0, 1\], got 1.5"),
    ("eta-negative", ["--eta", "-0.1"], InputError, r"--eta must be in \[0, 1\], got -0.1"),
    ("image-missing", ["--image", "{root}/missing.png"], FileNotFoundError, r"--image '.*missing.png': no such file"),
    ("image-not-an-image", ["--image", "{notes}"], InputError, r"--image: '.*notes.png' is not an image file"),
    # issue 18: '23x17' for a 17-wide image was misread
    ("image-not-a-multiple", ["--image", "{tall}"], InputError, r"^--image has width 17, height 23 pixels, not "
     r"multiples of 4 \(the VAE downsamples by 4\); resize or crop it to width 16, height 20 \(eqxdiff does not "
     r"resize input images\)$"),
    ("output-dir-is-a-file", ["--output-dir", "{taken}"], InputError, r"--output-dir '.*taken' is a file"),
    ("output-dir-under-a-file", ["--output-dir", "{taken}/sub/dir"], InputError, r"--output-dir '.*taken/sub/dir' "
     r"lies under '.*taken', which is a file; pass a folder \(created if missing\)"),
    # issue 18: a folder that cannot be made was found only after loading, compiling and generating
    ("output-dir-cannot-be-made", ["--output-dir", "/proc/eqxdiff/images"], InputError, r"^--output-dir "
     r"'/proc/eqxdiff/images' cannot be created \(FileNotFoundError: No such file or directory\); pass a folder you "
     r"can write to$"),
    ("cache-dir-and-no-cache", ["--compilation-cache-dir", "{root}/cache", "--no-compilation-cache"], InputError,
     r"^--compilation-cache-dir and --no-compilation-cache contradict each other; leave one out$"),
    ("cache-dir-without-folder", ["--compilation-cache-dir"], _command.FlagError, r"^--compilation-cache-dir: "
     r"expected one argument; --help shows its form$"),
    ("steps-beyond-schedule", ["--steps", "5000"], InputError, r"--num-inference-steps 5000 must be in \[1, "
     r"num_train_timesteps=1000\]"),
    ("strength-leaves-no-step", ["--image", "{square}", "--strength", "0.1", "--steps", "4"], InputError,
     r"--strength 0.1 with 4 steps leaves no denoising step; raise --num-inference-steps or move the fraction"),
    ("timesteps-outside-schedule", ["--timesteps", "5000", "10"], InputError, r"--timesteps \[5000\] fall "
     r"outside \[0, num_train_timesteps=1000\)"),
    # issue 18: an ascending custom schedule drew a garbled, green-tinted image with exit 0
    ("timesteps-ascending", ["--timesteps", "999", "500", "600", "1"], InputError, r"--timesteps \[999, 500, 600, "
     r"1\] must be strictly descending \(the noisiest step first\): 500 at position 1 is followed by 600"),
    ("timesteps-repeated", ["--timesteps", "900", "900", "1"], InputError, r"must be strictly descending"),
    ("guidance-extreme", ["--guidance-scale", "1e30"], InputError, r"--guidance-scale must be in \[0, 100\], got "
     r"1e\+30 \(1-20 is the useful range"),
    ("sigmas-not-taken", ["--sigmas", "1.0", "0.5"], InputError, r"DPMSolverMultistepScheduler.init does not take "
     r"--sigmas .*; it takes --timesteps"),
    ("scheduler-option-no-value", ["--scheduler-option", "clip_sample"], InputError, r"must be KEY=VALUE"),
    ("scheduler-option-unknown", ["--scheduler", "ddim", "--scheduler-option", "nope=1"], ConfigError,
     r"^--scheduler-option nope=1: --scheduler ddim's DDIMScheduler has no option 'nope' \(its options: .*clip_sample"
     r".*\); no --scheduler has it: leave it out$"),
    # issue 18: --help's example, refused by the digits model's DPM-Solver without saying why
    ("scheduler-option-of-another-scheduler", ["--scheduler-option", "clip_sample=false"], ConfigError,
     r"^--scheduler-option clip_sample=false: the --model folder's DPMSolverMultistepScheduler has no option "
     r"'clip_sample' \(its options: algorithm_type, .*timestep_spacing.*\); --scheduler ddim, .*ddpm.* have it: "
     r"pass one of those or leave the option out$"),
    ("scheduler-option-wrong-type", ["--scheduler", "ddim", "--scheduler-option", "clip_sample=3"], ConfigError,
     r"clip_sample=3 has the wrong type; clip_sample must be bool"),
    ("scheduler-option-bad-value", ["--scheduler-option", "algorithm_type=\"nope\""], ConfigError,
     r"algorithm_type='nope'"),
    ("scheduler-unknown", ["--scheduler", "nope"], _command.FlagError, r"^--scheduler 'nope' is not one of its "
     r"choices; choose one of ddim, pndm, euler, (?!.*None)"),
    ("dtype-unknown", ["--weights-dtype", "int8"], _command.FlagError, r"--weights-dtype 'int8' is not one of"),
    ("flag-unknown", ["--heigth", "16"], _command.FlagError, r"unrecognized argument\(s\) --heigth"),
    ("model-missing", ["--model", "{root}/nothing"], CheckpointError, r"model folder .*nothing' does not exist"),
    ("model-is-a-file", ["--model", "{taken}"], CheckpointError, r"is a file; pass the model's folder"),
    ("model-unknown-family", ["--model", "{unknown}"], CheckpointError, r"'HunyuanVideoPipeline' pipeline.*eqxdiff "
     r"serves .*StableDiffusionPipeline"),
    # issue 18: a training run's output folder, not its pipeline/
    ("model-is-a-run-folder", ["--model", "{trained}"], CheckpointError, r"model_index.json not found in .*trained'; "
     r"did you mean '.*trained/pipeline'\?"),
    ("model-index-broken", ["--model", "{broken}"], CheckpointError, r"model_index.json' is not valid JSON: .* line 1"),
    ("unet-missing", ["--unet", "{root}/missing_unet.safetensors"], FileNotFoundError, r"--unet "
     r"'.*missing_unet.safetensors': no such file or folder; pass a UNet .safetensors file in diffusers' names"),
    ("unet-pickle", ["--unet", "{unet}"], CheckpointError, r"--unet: '.*unet.ckpt' is a PyTorch pickle; eqxdiff "
     r"reads only .safetensors files"),
    ("unet-not-safetensors", ["--unet", "{notes}"], CheckpointError, r"--unet '.*notes.png' is not a .safetensors "
     r"file; pass a UNet .safetensors file in diffusers' names or a UNet folder"),
    ("unet-truncated", ["--unet", "{cut}"], CheckpointError, r"--unet: '.*cut.safetensors' is truncated or corrupt"),
    ("unet-file-not-a-unet", ["--unet", "{saved_vae}/diffusion_pytorch_model.safetensors"], CheckpointError,
     r"--unet .* holds no conv_in.weight: not a UNet in diffusers' names .*; a whole-model single file .* goes to "
     r"--model, with --config"),
    ("unet-folder-not-a-unet", ["--unet", "{saved_vae}"], CheckpointError, r"--unet '.*saved_vae' holds a "
     r"'AutoencoderKL' \(config.json _class_name\), not a UNet2DConditionModel, which a StableDiffusionPipeline runs "
     r"as its UNet"),
    ("unet-folder-without-config", ["--unet", "{out}"], CheckpointError, r"--unet '.*out' holds no config.json; "
     r"pass a UNet folder"),
    ("unet-for-a-pipeline-without-one", ["--model", "{flux}", "--unet", "{cut}"], InputError, r"--unet replaces a "
     r"pipeline's UNet, but the --model folder's FluxPipeline has none \(its models: vae, text_encoder, "
     r"text_encoder_2, transformer\); leave out --unet"),
    # issue 19: --lora FILE_OR_HUB_ID[:SCALE], checked against the model's configs before loading
    ("lora-missing", ["--lora", "{root}/missing_lora.safetensors:0.8"], FileNotFoundError, r"^--lora "
     r"'.*missing_lora.safetensors:0.8': no such file or folder; pass a LoRA .safetensors file, a folder holding one, "
     r"or a Hugging Face Hub id \(owner/name, or owner/name/FILE.safetensors\)$"),
    ("lora-pickle", ["--lora", "{unet}"], CheckpointError, r"^--lora '.*unet.ckpt' is a PyTorch pickle; eqxdiff reads "
     r"only .safetensors files .* Convert it once where you trust it: `sd = torch.load\(.*'unet.safetensors'\)`$"),
    ("lora-not-safetensors", ["--lora", "{notes}"], CheckpointError, r"^--lora '.*notes.png': '.*notes.png' is not a "
     r".safetensors file; eqxdiff reads LoRAs in safetensors$"),
    ("lora-another-family", ["--lora", "{flux_lora}"], CheckpointError, r"^--lora '.*flux_lora.safetensors': "
     r"'.*flux_lora.safetensors' is a LoRA for Flux.1 \(keys such as 'lora_unet_double_blocks_0_img_attn_qkv"
     r".lora_down.weight'\), not for Stable Diffusion 1.x/2.x; use it with a Flux.1 --model$"),
    ("lora-adapts-nothing-here", ["--lora", "{partly_lora}"], CheckpointError, r"^--lora '.*partly_lora.safetensors': "
     r"2 of the \d+ tensors of .* adapt nothing in this StableDiffusionPipeline \(text_encoder, unet\): "
     r"'lora_unet_nowhere.lora_down.weight', 'lora_unet_nowhere.lora_up.weight'. Check the file is for this model; "
     r"--no-lora-strict loads the rest with a warning$"),
    ("lora-scale-a-word", ["--lora", "{lora}:abc"], InputError, r"^--lora '.*lora.safetensors:abc': the scale 'abc' "
     r"after the last ':' is not a number; write FILE_OR_HUB_ID:SCALE, e.g. '.*lora.safetensors:0.8'$"),
    ("lora-scale-nan", ["--lora", "{lora}:nan"], InputError, r"^--lora '.*:nan': the scale nan is not finite; give a "
     r"finite number, e.g. '.*lora.safetensors:0.8'$"),
    ("lora-scale-inf", ["--lora", "{lora}:-inf"], InputError, r"^--lora '.*:-inf': the scale -inf is not finite"),
    ("lora-scale-without-file", ["--lora", ":0.5"], InputError, r"^--lora ':0.5' names no file; write "
     r"FILE_OR_HUB_ID:SCALE"),
    ("lora-rank-above-max", ["--lora", "{lora}", "--lora-max-rank", "1"], CheckpointError, r"^--lora "
     r"'.*lora.safetensors': an adapter of rank 2 does not fit --lora-max-rank 1; raise --lora-max-rank to at least "
     r"2$"),
    ("lora-max-rank-zero", ["--lora", "{lora}", "--lora-max-rank", "0"], InputError, r"^--lora-max-rank 0 must be "
     r">= 1"),
    ("lora-given-twice", ["--lora", "{lora}", "--lora", "{root}/./lora.safetensors:0.5"], InputError, r"^--lora "
     r"'.*lora.safetensors' and --lora '.*lora.safetensors:0.5' name the same file; give it once, with the scale you "
     r"want$"),
    ("fuse-lora-without-lora", ["--fuse-lora"], InputError, r"^--fuse-lora applies to --lora adapters; pass --lora "
     r"FILE_OR_HUB_ID or leave --fuse-lora out$"),
    ("lora-max-rank-a-word", ["--lora-max-rank", "high"], _command.FlagError, r"^--lora-max-rank expects an integer "
     r"or None, got 'high'$"),
    ("mesh-zero", ["--mesh.ici-fsdp-parallelism", "0"], MeshError, r"ici_fsdp_parallelism=0 must be a positive int"),
    ("mesh-two-fills", ["--mesh.ici-fsdp-parallelism", "-1"], MeshError, r"only one ici_\* parallelism may be -1"),
]

TRAIN = [
    ("cache-dir-and-no-cache", ["digits", "--no-compilation-cache", "--compilation-cache-dir", "{root}/cache"],
     InputError, r"^--compilation-cache-dir and --no-compilation-cache contradict each other; leave one out$"),
    ("cache-dir-without-folder", ["digits", "--compilation-cache-dir"], _command.FlagError,
     r"^--compilation-cache-dir: expected one argument; --help shows its form$"),
    ("resolution-zero", ["digits", "--resolution", "0"], ValueError, r"--resolution 0 must be >= 1"),
    ("resolution-not-multiple", ["digits", "--resolution", "18"], InputError, r"--resolution 18 must be a multiple "
     r"of 4 .*try --resolution 16"),
    ("seed-negative", ["digits", "--seed", "-1"], ValueError, r"--seed -1 must be in \[0, 2\*\*31\)"),
    ("seed-huge", ["digits", "--seed", str(2**40)], ValueError, r"--seed 1099511627776 must be in"),
    ("lr-nan", ["digits", "--optimizer.learning-rate", "nan"], ValueError, r"--optimizer.learning-rate nan must be a "
     r"positive"),
    ("lr-negative", ["digits", "--optimizer.learning-rate", "-1e-3"], ValueError, r"--optimizer.learning-rate -0.001 "
     r"must be"),
    ("beta-one", ["digits", "--optimizer.beta1", "1.0"], ValueError, r"--optimizer.beta1 1.0 must be in \[0, 1\)"),
    ("schedule-unknown", ["digits", "--optimizer.schedule", "step"], ValueError, r"--optimizer.schedule 'step'; "
     r"choose one of"),
    ("clip-norm-zero", ["digits", "--optimizer.max-grad-norm", "0"], ValueError, r"--optimizer.max-grad-norm 0.0 "
     r"must be > 0"),
    ("snr-nan", ["digits", "--objective.snr-gamma", "nan"], ValueError, r"--objective.snr-gamma nan must be "
     r"positive"),
    ("dropout-one", ["digits", "--objective.caption-dropout", "1.0"], ValueError, r"--objective.caption-dropout 1.0 "
     r"must be in"),
    ("prediction-unknown", ["digits", "--objective.prediction-type", "noise"], ValueError,
     r"--objective.prediction-type 'noise'; choose one of"),
    ("offset-inf", ["digits", "--objective.noise-offset", "inf"], ValueError, r"--objective.noise-offset inf must be "
     r">= 0"),
    ("ema-one", ["digits", "--ema-decay", "1.0"], ValueError, r"--ema-decay 1.0 must be in \(0, 1\)"),
    ("kl-nan", ["digits", "--kl-weight", "nan"], ValueError, r"--kl-weight nan must be a finite number"),
    ("vae-lr-zero", ["digits", "--autoencoder-learning-rate", "0"], ValueError, r"--autoencoder-learning-rate 0.0 "
     r"must be a positive number"),
    ("sample-guidance-inf", ["digits", "--sample-guidance-scale", "inf"], ValueError, r"--sample-guidance-scale inf "
     r"must be finite"),
    ("batch-zero", ["digits", "--batch-size", "0"], ValueError, r"--batch-size 0 must be >= 1"),
    ("checkpoint-every-negative", ["digits", "--checkpoint-every", "-1"], ValueError, r"--checkpoint-every -1 must "
     r"be >= 0 \(0: never\)"),
    ("architecture-odd-size", ["digits", "--architecture.image-size", "18"], ValueError, r"--architecture.image-size "
     r"18 must be a multiple of 4"),
    ("architecture-no-channels", ["digits", "--architecture.unet-channels"], ValueError, r"--architecture."
     r"unet-channels is empty"),
    ("architecture-groups", ["digits", "--architecture.norm-num-groups", "7"], ConfigError, r"--architecture."
     r"norm-num-groups 7 must be an int dividing every block_out_channels"),
    ("export-into-shipped-model", ["digits", "--export-dir", str(DIGITS)], InputError, r"--export-dir .* is inside "
     r"the 'digits' model shipped with eqxdiff; pass another folder"),
    ("export-dir-is-a-file", ["digits", "--export-dir", "{taken}"], InputError, r"--export-dir '.*taken' is a file"),
    ("export-dir-under-a-file", ["digits", "--export-dir", "{taken}/pipeline"], InputError, r"--export-dir "
     r"'.*taken/pipeline' lies under '.*taken', which is a file; pass a folder \(created if missing\)"),
    ("output-dir-is-a-file", ["digits", "--output-dir", "{taken}"], InputError, r"--output-dir '.*taken' is a file"),
    ("output-dir-under-a-file", ["digits", "--output-dir", "{taken}/runs/a"], InputError, r"--output-dir "
     r"'.*taken/runs/a' lies under '.*taken', which is a file"),
    ("output-dir-cannot-be-made", ["digits", "--output-dir", "/proc/eqxdiff-run"], InputError, r"^--output-dir "
     r"'/proc/eqxdiff-run' cannot be created \(FileNotFoundError: No such file or directory\); pass a folder you can "
     r"write to$"),
    ("export-dir-cannot-be-made", ["digits", "--export-dir", "/sys/eqxdiff/pipeline"], InputError, r"^--export-dir "
     r"'/sys/eqxdiff/pipeline' cannot be created \(PermissionError: .*\); pass a folder you can write to$"),
    ("export-scheduler-unknown", ["digits", "--export-scheduler", "nope"], ValueError, r"--export-scheduler 'nope'; "
     r"choose one of"),
    ("export-dtype-unknown", ["digits", "--export-dtype", "fp33"], CheckpointError, r"--export-dtype 'fp33': unknown "
     r"dtype 'fp33'"),
    ("fine-tune-without-data", ["sd15"], ValueError, r"fine-tuning needs training data: set one of --data \(digits, "
     r"synthetic or an image folder\), --hf-dataset or --tfrecord"),
    ("two-sources", ["digits", "--data", "x", "--hf-dataset", "y"], ValueError, r"give one data source, got "
     r"--data 'x' and --hf-dataset 'y'; keep one of --data"),
    ("key-for-another-source", ["digits", "--image-key", "jpeg"], ValueError, r"--image-key 'jpeg' is for the "
     r"tfrecord source, but the data source is 'digits'; remove it"),
    ("mesh-negative", ["digits", "--mesh.ici-data-parallelism", "-2"], MeshError, r"--mesh.ici-data-parallelism -2 "
     r"must be a positive int"),
    ("remat-named-without-names", ["digits", "--remat", "NAMED"], ValueError, r"--remat 'named' needs --remat-names"),
    ("preset-unknown", ["sd99"], _command.FlagError, r"unknown preset 'sd99'; a command line starts with a preset, "
     r"one of digits, sd15, sd21, sdxl, flux-dev, flux-schnell"),
    ("preset-missing", ["--steps", "3"], _command.FlagError, r"^a command line starts with a preset, one of digits, "
     r"sd15"),
    ("steps-a-word", ["digits", "--steps", "abc"], _command.FlagError, r"^--steps expects an integer, got 'abc'$"),
    ("steps-nan", ["digits", "--steps", "nan"], _command.FlagError, r"^--steps expects an integer, got 'nan'$"),
    ("steps-a-fraction", ["digits", "--steps=1.5"], _command.FlagError, r"^--steps expects an integer, got '1.5'$"),
    ("lr-a-word", ["digits", "--optimizer.learning-rate", "fast"], _command.FlagError, r"^--optimizer.learning-rate "
     r"expects a number, got 'fast'$"),
    ("ema-a-word", ["digits", "--ema-decay", "x"], _command.FlagError, r"^--ema-decay expects a number or None, got "
     r"'x'$"),
    ("profile-steps-a-word", ["digits", "--profile-steps", "1", "x"], _command.FlagError, r"^--profile-steps expects "
     r"integers, got 'x'$"),
    ("mesh-a-word", ["digits", "--mesh.ici-data-parallelism", "two"], _command.FlagError, r"^--mesh.ici-data-"
     r"parallelism expects an integer, got 'two'$"),
    ("family-option-a-word", ["flux-dev", "--data", "x", "--family.max-sequence-length", "many"], _command.FlagError,
     r"^--family.max-sequence-length expects an integer, got 'many'$"),
    ("resume-changed", ["digits", "--output-dir", "{run}", "--steps", "200", "--optimizer.learning-rate", "0.01"],
     CheckpointMismatchError, r"^cannot resume from .*/run/checkpoints/55, trained with other settings: "
     r"--optimizer.learning-rate 0.001 -> 0.01; give its settings to resume, --no-resume to start over \(replacing "
     r"its checkpoints\), or --output-dir <another folder>$"),
    ("resume-longer-schedule", ["digits", "--output-dir", "{run}", "--steps", "300", "--optimizer.learning-rate",
                                "0.001"], CheckpointMismatchError, r"trained with other settings: "
     r"--optimizer.total-steps 200 -> 300 \(--steps 300 sets it unless it is given: --optimizer.total-steps 200 keeps "
     r"the schedule\); give its settings"),
    ("resume-long-value", ["digits", "--output-dir", "{run}", *RUN_FLAGS, "--seed", "3", "--tfrecord",
                           *(f"shard-{i:05d}.tfrecord" for i in range(20))], CheckpointMismatchError,
     r"trained with other settings: --seed 0 -> 3, --tfrecord \[\] -> \['shard-00000.tfrecord', \.\.\. 20 items\]; "),
]


def _argv(argv, ws) -> list[str]:
    return [a.format(**ws.paths, root=ws.root) for a in argv]


def _check_command(command, argv, error, match, capsys, monkeypatch):
    with pytest.raises(error, match=match) as info:
        command.validate(argv)
    one_line(str(info.value))
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", [f"eqxdiff-{command.__name__.rsplit('.', 1)[-1]}", *argv])
    with pytest.raises(SystemExit) as exit_info:
        command.cli()
    lines = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert lines[0] == f"error: {info.value}"


@pytest.mark.parametrize(("argv", "error", "match"), [c[1:] for c in GENERATE], ids=[c[0] for c in GENERATE])
def test_generate_refuses_before_loading(argv, error, match, ws, unchanged, capsys, monkeypatch):
    monkeypatch.setattr(generate, "load_pipeline", _must_not_load)
    _check_command(generate, _argv(argv, ws), error, match, capsys, monkeypatch)


@pytest.mark.parametrize(("argv", "error", "match"), [c[1:] for c in TRAIN], ids=[c[0] for c in TRAIN])
def test_train_refuses_before_loading(argv, error, match, ws, unchanged, capsys, monkeypatch):
    monkeypatch.setattr(train, "run", _must_not_load)
    _check_command(train, _argv(argv, ws), error, match, capsys, monkeypatch)


def _must_not_load(*args, **kwargs):
    raise AssertionError("a bad flag must be refused before anything is loaded")


def _must_not_compile(*args, **kwargs):
    raise AssertionError("a bad input must be refused before anything is encoded or compiled")


# -- the table: the Python API ------------------------------------------------------------------------------------

NAN_LATENTS = np.full((1, 4, 4, 4), np.nan, np.float32)


def _smaller_vocabulary(pipe):
    encoder = copy.copy(pipe.text_encoder)  # the same weights, a config that says the vocabulary is smaller
    object.__setattr__(encoder, "config", dataclasses.replace(pipe.text_encoder.config, vocab_size=20))
    new = type(pipe).from_pipe(pipe, text_encoder=encoder)
    return new("a handwritten digit seven", progress=False)


def _failing_writer(*args, **kwargs):
    raise OSError("No space left on device")


def _save_failing_half_way(ctx, what):
    ctx.monkeypatch.setattr(checkpoint_module, "write_safetensors", _failing_writer)
    if what == "model":
        eqxdiff.save_pretrained(ctx.pipe.unet, ctx.ws.paths["saved_vae"])
    else:
        eqxdiff.save_pipeline(ctx.pipe, ctx.ws.paths["saved_pipe"])


# (id, call(ctx) with ctx.pipe / ctx.ws / ctx.monkeypatch, error type, message pattern)
API = [
    ("prompt-int", lambda c: c.pipe(123), InputTypeError, r"prompt must be a string or a list of strings, got int"),
    ("prompt-none", lambda c: c.pipe(None), ValueError, r"pass prompt or prompt_embeds"),
    ("prompt-empty-list", lambda c: c.pipe([]), InputError, r"prompt is an empty list"),
    ("prompt-list-of-ints", lambda c: c.pipe(["a", 2]), InputTypeError, r"prompt must be a string or a list of "
     r"strings"),
    ("height-zero", lambda c: c.pipe("a", height=0), InputError, r"height=0 must be a positive multiple of 4"),
    ("height-float", lambda c: c.pipe("a", height=16.0), InputTypeError, r"height=16.0 must be an int"),
    ("steps-float", lambda c: c.pipe("a", num_inference_steps=2.0), InputTypeError, r"num_inference_steps=2.0 must "
     r"be an int"),
    ("steps-beyond-schedule", lambda c: c.pipe("a", num_inference_steps=5000, progress=False), ValueError,
     r"num_inference_steps=5000 must be in \[1, num_train_timesteps=1000\]"),
    ("guidance-nan", lambda c: c.pipe("a", guidance_scale=float("nan")), InputError, r"guidance_scale=nan"),
    ("clip-skip-bool", lambda c: c.pipe("a", clip_skip=True), InputTypeError, r"clip_skip=True must be an int"),
    ("latents-nan", lambda c: c.pipe("a", latents=NAN_LATENTS), InputError, r"latents holds 64 NaN or infinite "
     r"value\(s\) of 64: the initial noise must be finite"),
    ("prompt-embeds-inf", lambda c: c.pipe(prompt_embeds=np.full((1, 32, 32), np.inf, np.float32)), InputError,
     r"prompt_embeds holds 1024 NaN or infinite"),
    ("image-nan", lambda c: c.pipe("a", image=np.full((16, 16, 3), np.nan, np.float32)), InputError,
     r"image holds 768 NaN"),
    ("image-not-a-multiple", lambda c: c.pipe("a", image=np.zeros((1, 18, 20, 3), np.uint8)), InputError,
     r"image has width 20, height 18 pixels, not multiples of 4 .* resize or crop it to width 20, height 16"),
    ("strength-zero", lambda c: c.pipe("a", image=np.zeros((16, 16, 3), np.uint8), strength=0.0), InputError,
     r"strength must be in \(0, 1\], got 0.0"),
    ("strength-without-image", lambda c: c.pipe("a", strength=0.5), InputError, r"strength=0.5 applies to "
     r"image-to-image only; pass image="),
    ("mask-without-image", lambda c: c.pipe("a", mask_image=np.ones((16, 16), np.uint8)), InputError,
     r"mask_image needs image="),
    ("unknown-argument", lambda c: c.pipe("a", guidance=3), InputTypeError, r"unexpected keyword argument "
     r"'guidance'"),
    # diffusers' arguments eqxdiff does not take by design: the error says what to do instead
    ("diffusers-generator", lambda c: c.pipe("a", generator=object()), InputTypeError, r"unexpected keyword "
     r"argument 'generator' \(eqxdiff draws its noise from seed= \(an int\) or key= \(a jax.random key\)"),
    ("diffusers-return-dict", lambda c: c.pipe("a", return_dict=False), InputTypeError, r"'return_dict' \(eqxdiff "
     r"returns the images \(or videos\) themselves"),
    ("diffusers-callback", lambda c: c.pipe("a", callback_on_step_end=print), InputTypeError,
     r"'callback_on_step_end' \(the denoising loop is one compiled program.*output_type='latent'"),
    ("diffusers-ip-adapter", lambda c: c.pipe("a", ip_adapter_image=np.zeros((16, 16, 3), np.uint8)),
     InputError, r"ip_adapter_image / ip_adapter_image_embeds: no IP-Adapter is loaded; load one first: "
     r"pipe.load_ip_adapter\("),
    ("diffusers-masked-image-latents", lambda c: c.pipe("a", masked_image_latents=np.zeros((1, 4, 4, 4))),
     InputError, r"masked_image_latents are an inpainting UNet's input \(9 channels\), with mask_image="),
    ("lora-scale-other-key", lambda c: c.pipe("a", cross_attention_kwargs={"scale": 0.5, "heads": 2}), InputError,
     r"cross_attention_kwargs holds \['heads'\]: eqxdiff takes only 'scale' there .* attention processors, which "
     r"eqxdiff does not have"),
    ("ip-adapter-masks", lambda c: c.pipe("a", cross_attention_kwargs={"ip_adapter_masks": [np.ones((1, 1, 8, 8))]}),
     InputError, r"ip_adapter_masks: no IP-Adapter is loaded; load one first"),
    ("lora-scale-not-a-number", lambda c: c.pipe("a", cross_attention_kwargs={"scale": "high"}), InputTypeError,
     r"cross_attention_kwargs=\{'scale': 'high'\}: the scale must be a finite number"),
    ("lora-scale-other-family", lambda c: c.pipe("a", joint_attention_kwargs={"scale": 0.5}), InputTypeError,
     r"'joint_attention_kwargs' \(a StableDiffusionPipeline takes the call's LoRA scale as "
     r"cross_attention_kwargs=\{'scale': s\}\)"),
    ("seed-float", lambda c: c.pipe("a", seed=1.5), InputTypeError, r"seed=1.5 must be an int"),
    ("seed-and-key", lambda c: c.pipe("a", seed=1, key=jax.random.key(1)), InputError, r"pass seed= or key=, not "
     r"both"),
    ("key-batch", lambda c: c.pipe("a", key=jax.random.split(jax.random.key(0), 2)), InputError, r"key has shape "
     r"\(2,\): a batch of 2 keys, but a call draws all its noise from one key; pass one \(key=keys\[0\]\)"),
    ("key-raw-batch", lambda c: c.pipe("a", key=jax.random.split(jax.random.PRNGKey(0), 3)), InputError,
     r"key has shape \(3, 2\): a batch of 3 keys"),
    ("key-int", lambda c: c.pipe("a", key=5), InputTypeError, r"key=5 is an int; pass seed=5"),
    ("key-float", lambda c: c.pipe("a", key=np.zeros(2, np.float32)), InputError, r"key of dtype float32 and shape "
     r"\(2,\) is not a PRNG key"),
    ("output-type", lambda c: c.pipe("a", output_type="pt"), InputError, r"output_type='pt'; choose one of \('uint8', "
     r"'np', 'pil', 'latent'\)"),
    ("negative-prompts-count", lambda c: c.pipe("a", negative_prompt=["x", "y"], progress=False), InputError,
     r"negative_prompt has 2 entries but prompt has 1"),
    ("timesteps-empty", lambda c: c.pipe("a", timesteps=[]), InputError, r"timesteps must be a non-empty list"),
    ("timesteps-ascending", lambda c: c.pipe("a", timesteps=[1, 500, 999]), ValueError, r"timesteps=\[1, 500, 999\] "
     r"must be strictly descending"),
    ("sigmas-ascending", lambda c: c.pipe.with_scheduler("euler")("a", sigmas=[0.0, 3.0, 14.0]), ValueError,
     r"sigmas=\[0.0, 3.0, 14.0\] must be strictly descending"),
    ("guidance-extreme", lambda c: c.pipe("a", guidance_scale=1e30), InputError, r"guidance_scale must be in "
     r"\[0, 100\], got 1e\+30"),
    ("guidance-negative", lambda c: c.pipe("a", guidance_scale=-3.0), InputError, r"guidance_scale must be in "
     r"\[0, 100\], got -3.0"),
    ("sigmas-nan", lambda c: c.pipe("a", sigmas=[1.0, float("nan")]), InputError, r"sigmas=\[1.0, nan\]"),
    ("denoising-start-out-of-range", lambda c: eqxdiff.pipelines.check_arguments({"denoising_start": 1.5}),
     InputError, r"denoising_start=1.5 must be a float in \(0, 1\)"),
    ("denoising-start-one", lambda c: eqxdiff.pipelines.check_arguments({"denoising_start": 1.0}), InputError,
     r"denoising_start=1.0 must be a float in \(0, 1\)"),  # diffusers ignores it and noises the image to strength
    ("denoising-end-zero", lambda c: eqxdiff.pipelines.check_arguments({"denoising_end": 0.0}), InputError,
     r"denoising_end=0.0 must be a float in \(0, 1\]"),  # (1.0: the whole schedule, as diffusers runs it)
    ("denoising-start-without-image", lambda c: StableDiffusionXLPipeline.check_arguments(
        {"prompt": "a", "image": None, "denoising_start": 0.8}), InputError,
     r"denoising_start needs image= \(the latents .*\); got denoising_start=0.8 alone"),
    ("strength-leaves-no-step", lambda c: c.pipe("a", image=np.zeros((16, 16, 3), np.uint8), strength=0.1,
                                                 num_inference_steps=4), ValueError, r"strength=0.1 with 4 steps "
     r"leaves no denoising step"),
    ("hand-off-order", lambda c: eqxdiff.pipelines.check_arguments({"denoising_start": 0.8, "denoising_end": 0.5}),
     InputError, r"denoising_start=0.8 must be smaller than denoising_end=0.5"),
    ("tokenizer-outside-vocabulary", lambda c: _smaller_vocabulary(c.pipe), CheckpointError, r"token id \d+, "
     r"outside the text encoder's vocabulary of 20"),
    ("load-a-run-folder", lambda c: eqxdiff.load_pipeline(c.ws.paths["trained"]), CheckpointError,
     r"model_index.json not found in .*trained'; did you mean '.*trained/pipeline'\?"),
    ("load-a-pipeline-folder-as-a-model", lambda c: eqxdiff.load(c.ws.paths["saved_pipe"]), CheckpointError,
     r"config.json not found in .*saved_pipe'; its subfolders .*unet.*vae each hold one: pass the one you mean"),
    ("save-not-a-model", lambda c: eqxdiff.save_pretrained([1, 2], c.ws.paths["saved_vae"]), CheckpointError,
     r"save_pretrained needs an eqxdiff model .* got list"),
    ("save-bad-dtype", lambda c: eqxdiff.save_pretrained(c.pipe.vae, c.ws.paths["saved_vae"], dtype="fp33"),
     CheckpointError, r"unknown dtype 'fp33'"),
    ("save-int-dtype", lambda c: eqxdiff.save_pretrained(c.pipe.vae, c.ws.paths["saved_vae"], dtype="int8"),
     CheckpointError, r"models cannot run in dtype int8"),
    ("save-into-a-file", lambda c: eqxdiff.save_pretrained(c.pipe.vae, c.ws.paths["taken"]), CheckpointError,
     r"taken' is a file; pass a folder"),
    ("save-fails-half-way", lambda c: _save_failing_half_way(c, "model"), OSError, r"No space left on device"),
    ("save-pipeline-bad-dtype", lambda c: eqxdiff.save_pipeline(c.pipe, c.ws.paths["saved_pipe"], dtype="fp33"),
     CheckpointError, r"unknown dtype 'fp33'"),
    ("save-pipeline-not-a-pipeline", lambda c: eqxdiff.save_pipeline(c.pipe.unet, c.ws.paths["saved_pipe"]),
     CheckpointError, r"save_pipeline needs an eqxdiff pipeline, got UNet2DConditionModel"),
    ("save-pipeline-fails-half-way", lambda c: _save_failing_half_way(c, "pipeline"), OSError, r"No space left"),
    ("scheduler-option-unknown", lambda c: eqxdiff.load_pipeline("digits", scheduler_options={"nope": 1}),
     ConfigError, r"DPMSolverMultistepScheduler has no config option\(s\) \['nope'\]"),
    ("with-scheduler-unknown-option", lambda c: c.pipe.with_scheduler("ddim", clip_samples=False), ConfigError,
     r"DDIMScheduler has no config option\(s\) \['clip_samples'\]"),
    ("read-image-not-an-image", lambda c: read_image(c.ws.paths["notes"]), InputError, r"notes.png' is not an "
     r"image file Pillow can read"),
    ("read-image-missing", lambda c: read_image(c.ws.root / "missing.png"), FileNotFoundError, r"image file .* not "
     r"found"),
    ("nan-output", lambda c: check_finite_output(np.stack([np.zeros((4, 4, 3)), np.full((4, 4, 3), np.nan)]),
                                                 what="images", hint="run in float32"),
     NonFiniteError, r"the model produced NaN or infinite values in 1 of 2 images; run in float32"),
    ("train-config-seed", lambda c: eqxdiff.train.TrainConfig(seed=2**31), ValueError, r"seed=2147483648 must be"),
    ("architecture-empty", lambda c: eqxdiff.train.DigitsArchitecture(vae_channels=()), ValueError,
     r"architecture.vae_channels is empty"),
    ("optimizer-eps", lambda c: eqxdiff.train.OptimizerConfig(eps=0.0), ValueError, r"eps=0.0 must be > 0"),
    ("load-data-unknown", lambda c: eqxdiff.train.load_data(eqxdiff.train.TrainConfig(data="nowhere"), None),
     DataError, r"^data='nowhere' names no folder: give 'digits', 'synthetic' or a folder of images or clips with "
     r"captions; for a Hugging Face dataset"),
]


@pytest.mark.parametrize(("call", "error", "match"), [c[1:] for c in API], ids=[c[0] for c in API])
def test_python_api_refuses_before_compiling(call, error, match, pipe, ws, unchanged, monkeypatch):
    from eqxdiff.pipelines import _latents, stable_diffusion

    for module, name in ((stable_diffusion, "encode_prompt"), (_latents, "denoise_loop"),
                         (_latents, "encode_image_latents"), (_latents, "decode_latents")):
        monkeypatch.setattr(module, name, _must_not_compile)
    ctx = types.SimpleNamespace(pipe=pipe, ws=ws, monkeypatch=monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InputWarning)
        with pytest.raises(error, match=match) as info:
            call(ctx)
    one_line(str(info.value))


def test_the_table_is_long_enough():
    assert len(GENERATE) + len(TRAIN) + len(API) >= 60


# -- warnings: accepted, but not what was asked -------------------------------------------------------------------

WARNINGS = [
    ("prompt-too-long", {"prompt": "a handwritten digit seven " * 3}, r"has 68 tokens but the text encoder reads 32: "
     r"36 token\(s\) were cut off, starting 'tten digit seven a handwritt'.... Shorten the prompt"),
    ("numerals", {"prompt": "a handwritten digit 7"}, r"the tokenizer does not know '7' .* reads it as "
     r"'<\|endoftext\|>'; reword the prompt"),
    ("far-above-native-size", {"prompt": "a", "image": np.zeros((512, 512, 3), np.uint8)},
     r"an output of width 512, height 512 pixels is 1024x the model's native size \(width 16, height 16\): its "
     r"attention runs over 16384 latent tokens \(a dense score matrix alone takes 1.0 GiB per head and image\)"),
]


@pytest.mark.parametrize(("arguments", "match"), [c[1:] for c in WARNINGS], ids=[c[0] for c in WARNINGS])
def test_warnings_say_what_happened(arguments, match, pipe, monkeypatch):
    from eqxdiff.pipelines import stable_diffusion

    # Stop right after the checks and the tokenizer: nothing is encoded or compiled.
    monkeypatch.setattr(stable_diffusion, "encode_prompt", _stop)
    with pytest.warns(InputWarning, match=match), pytest.raises(_Stopped):
        pipe(**arguments, progress=False)


class _Stopped(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stopped


def test_large_input_warns_before_loading(ws, monkeypatch, capsys):
    """The command line warns (one line) before it loads, estimating the size from the image file."""
    big = ws.root / "cwd" / "big.png"
    try:
        Image.fromarray(np.zeros((512, 512, 3), np.uint8)).save(big)
        with pytest.warns(InputWarning, match="width 512, height 512 pixels is 1024x"):
            generate.validate(["--image", str(big), "--strength", "0.5"])
    finally:
        big.unlink()


# -- one way to report: run_command -------------------------------------------------------------------------------

def _raising(error):
    def main(argv, *, prog=None):
        raise error
    return main


def test_run_command_reports_each_kind_of_failure_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["eqxdiff-train"])
    cases = [
        (TrainingInterrupted(40, tmp_path / "checkpoints"), 130,
         rf"training interrupted at step 40; checkpoint saved in {tmp_path}/checkpoints \(run the same command to "
         r"resume\)"),
        (CheckpointMismatchError("checkpoints was written by a different model; nothing was restored.\nArrays that "
                                 "differ:\n  unet.conv_in.weight: [3] -> [4]\nResume with that run's settings."), 2,
         r"error: checkpoints was written .* restored. Arrays that differ: unet.conv_in.weight: \[3\] -> \[4\]; "
         r"Resume with"),
        (KeyboardInterrupt(), 130, r"interrupted"),
        (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 68719476736 bytes.\n"
                                    "BufferAssignment OOM Debugging."), 1,
         r"error: out of memory \(RESOURCE_EXHAUSTED: Out of memory while trying to allocate 68719476736 bytes.\); "
         r"to lower memory: a smaller --batch-size"),
        (NonFiniteError("the model produced NaN"), 1, r"error: the model produced NaN"),
        (OSError("disk full"), 2, r"error: disk full"),
    ]
    for error, code, match in cases:
        with pytest.raises(SystemExit) as info:
            _command.run_command(_raising(error), [], memory_hint=train.MEMORY_HINT, interrupted=TrainingInterrupted)
        lines = capsys.readouterr().err.splitlines()
        assert info.value.code == code and len(lines) == 1, (error, lines)
        assert re.fullmatch(match + ".*", lines[0]), lines[0]
    # Anything else is a bug: its traceback is shown.
    with pytest.raises(ZeroDivisionError):
        _command.run_command(_raising(ZeroDivisionError()), [])
    # --debug shows the traceback of user errors too, and is not passed on.
    seen = []
    with pytest.raises(InputError):
        _command.run_command(lambda argv, prog=None: seen.append(argv) or _raising(InputError("x"))(argv),
                             ["--steps", "2", "--debug"])
    assert seen == [["--steps", "2"]]


def test_warnings_print_one_line_each(capsys):
    def main(argv, *, prog=None):
        warnings.warn("first line\nsecond line", InputWarning, stacklevel=1)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        _command.run_command(main, [])
    assert capsys.readouterr().err.splitlines() == ["warning: first line; second line"]


def _stop_after_the_checks(*args, **kwargs):
    raise InputError("stopped after the call's checks")


def test_a_warning_prints_once_though_checked_before_loading_and_in_the_call(ws, unchanged, monkeypatch, capsys):
    """The size estimate warns in ``validate`` (before loading) and again in the pipeline's own checks: the command
    prints it once. (Python's warning filter would not hide the second: they come from different lines.)"""
    from eqxdiff.pipelines import stable_diffusion

    monkeypatch.setattr(stable_diffusion, "encode_prompt", _stop_after_the_checks)  # the digits model loads: no compile
    monkeypatch.setattr(sys, "argv", ["eqxdiff-generate", "--height", "512", "--width", "512"])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with pytest.raises(SystemExit) as info:
            generate.cli()
    lines = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and lines[-1] == "error: stopped after the call's checks", lines
    warned = [line for line in lines if line.startswith("warning:")]
    assert len(warned) == 1 and warned[0].startswith("warning: an output of width 512, height 512 pixels is 1024x the "
                                                     "model's native size (width 16, height 16)"), lines


# -- nothing is lost ----------------------------------------------------------------------------------------------

def test_a_save_replaces_the_folder_whole_and_keeps_what_is_not_its_own(pipe, tmp_path):
    folder = tmp_path / "vae"
    eqxdiff.save_pretrained(pipe.vae, folder)
    (folder / "README.md").write_text("mine")
    (folder / "pytorch_lora_weights.safetensors").write_bytes(b"not eqxdiff's")
    (folder / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"the old weights' variant")
    eqxdiff.save_pretrained(pipe.vae, folder, dtype="bfloat16")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json",
                                                        "diffusion_pytorch_model.safetensors",
                                                        "pytorch_lora_weights.safetensors"]
    assert eqxdiff.load(folder).encoder.conv_in.weight.dtype == jax.numpy.float32  # loads (cast on read)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vae"]  # no temporary folder left behind


def test_an_output_folder_this_process_cannot_write_in_is_refused(ws, unchanged, monkeypatch):
    """A missing --output-dir / --export-dir whose nearest existing folder denies writing is refused before loading
    or training. (The tests run as root, which a chmod does not stop: the permission check's answer is set here.)"""
    locked, access = ws.root / "out", os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != locked and access(path, mode, **kw))
    monkeypatch.setattr(generate, "load_pipeline", _must_not_load)
    monkeypatch.setattr(train, "run", _must_not_load)
    cases = [(generate, ["--output-dir", f"{locked}/new/images"], "--output-dir"),
             (train, ["digits", "--export-dir", f"{locked}/pipeline"], "--export-dir"),
             (train, ["digits", "--output-dir", str(locked)], "--output-dir")]
    for command, argv, flag in cases:
        with pytest.raises(InputError, match=rf"^{flag} '{argv[-1]}': no permission to write in '{locked}'; pass a "
                                             r"folder you can write to$") as info:
            command.validate(argv)
        one_line(str(info.value))
    generate.validate(["--output-dir", f"{ws.root}/cwd/new/images"])  # beside it, a folder it may create: accepted


def test_an_output_folder_that_takes_no_file_is_refused(ws, unchanged, monkeypatch):
    """``os.access`` answers yes to root, even on a read-only mount: the check makes the folder (if missing) and a
    file in it, and removes what it made (``unchanged``: nothing is left). Here the file cannot be made (issue 18:
    the images were lost after loading, compiling and generating)."""
    locked, mkstemp = ws.root / "out", tempfile.mkstemp

    def refuse_in_locked(*args, dir=None, **kwargs):
        if dir is not None and (Path(dir) == locked or locked in Path(dir).parents):
            raise OSError(errno.EROFS, "Read-only file system")
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refuse_in_locked)
    monkeypatch.setattr(generate, "load_pipeline", _must_not_load)
    monkeypatch.setattr(train, "run", _must_not_load)
    cases = [(generate, ["--output-dir", str(locked)], "--output-dir"),
             (generate, ["--output-dir", f"{locked}/new/images"], "--output-dir"),
             (train, ["digits", "--export-dir", f"{locked}/pipeline"], "--export-dir")]
    for command, argv, flag in cases:
        with pytest.raises(InputError, match=rf"^{flag} '{re.escape(argv[-1])}' cannot be written in \(OSError: "
                                             r"Read-only file system\); pass a folder you can write to$") as info:
            command.validate(argv)
        one_line(str(info.value))


def test_train_resume_changing_only_what_may_change_passes_the_checks(ws, unchanged):
    """Resuming the interrupted run with another checkpoint frequency and sample steps (settings that may change on
    resume) passes the checks; the run notes the changes."""
    config = train.validate(["digits", "--output-dir", ws.paths["run"], *RUN_FLAGS, "--checkpoint-every", "50",
                             "--sample-steps", "10"])
    point = eqxdiff.train.resume_point(config)
    assert point.step == 55 and point.note == (f"resuming from {ws.paths['run']}/checkpoints/55 with settings that "
                                               "may change on resume: checkpoint_every=0 -> 50, sample_steps=20 -> 10")


def test_train_exports_outside_the_package():
    config = train.validate(["digits"])
    export = Path(config.export_dir or Path(config.output_dir) / "pipeline")
    assert DIGITS not in export.resolve().parents and export.resolve() != DIGITS


# -- limits, seeds and schedulers ---------------------------------------------------------------------------------

def test_limits_read_before_loading_equal_the_loaded_models(pipe):
    def read(path):
        file = DIGITS / path
        return json.loads(file.read_text()) if file.is_file() else None

    assert type(pipe).folder_limits(read) == pipe.call_limits() == CallLimits(4, (16, 16), 2)
    # SDXL takes the penultimate layer by default: one layer less to skip; the smaller encoder decides.
    vae = {"block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
           "up_block_types": ["UpDecoderBlock2D"] * 4}  # read through AutoencoderKLConfig: a config it accepts
    configs = {"vae/config.json": vae, "unet/config.json": {"sample_size": 128},
               "text_encoder/config.json": {"num_hidden_layers": 12},
               "text_encoder_2/config.json": {"num_hidden_layers": 32}}
    assert StableDiffusionXLPipeline.folder_limits(configs.get) == CallLimits(8, (1024, 1024), 11)


def test_limits_from_declared_components():
    """A family declaring LIMIT_COMPONENTS gets folder_limits (before loading) and call_limits from one limits_from:
    the configs in that order, None for a missing one."""
    from eqxdiff.pipelines.flux import FluxPipeline
    from eqxdiff.pipelines.ltx import LTXPipeline
    from eqxdiff.pipelines.ltx_upsample import LTXLatentUpsamplePipeline
    from eqxdiff.pipelines.wan import WanPipeline

    vae = {"block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
           "up_block_types": ["UpDecoderBlock2D"] * 4, "latent_channels": 16}
    assert FluxPipeline.folder_limits({"vae/config.json": vae}.get) == CallLimits(16, (1024, 1024))
    ltx = LTXLatentUpsamplePipeline.folder_limits({"vae/config.json": {}}.get)  # 0.9.0's VAE: 32x, 8 frames
    assert (ltx.size_factor, ltx.frame_factor) == (32, 8)
    assert LTXPipeline.folder_limits({"vae/config.json": {}}.get).size_factor == 32  # no transformer: 1x1 patches
    assert WanPipeline.folder_limits({}.get) == LTXPipeline.folder_limits({}.get) == CallLimits()


def test_a_key_is_typed_or_raw_and_replaces_the_folders_seed(pipe, monkeypatch):
    """A raw uint32 key (jax.random.PRNGKey's, also as NumPy) is the typed key of its data; a key given replaces the
    folder's seed default (digits' call_defaults hold seed=0: key= was refused as 'pass seed= or key=, not both')."""
    from eqxdiff.pipelines import stable_diffusion
    from eqxdiff.pipelines._arguments import resolve_key

    typed = jax.random.key_data(jax.random.key(3)).tolist()
    for raw in (jax.random.PRNGKey(3), np.asarray(jax.random.PRNGKey(3))):
        assert jax.random.key_data(resolve_key(None, raw)).tolist() == typed
    assert pipe.call_defaults.get("seed") is not None
    monkeypatch.setattr(stable_diffusion, "encode_prompt", _stop)
    for key in (jax.random.key(1), jax.random.PRNGKey(1)):
        with pytest.raises(_Stopped):  # past the checks and the key, at the text encoder
            pipe("a", key=key, progress=False)


def test_any_int_is_a_seed():
    assert jax.random.key_data(seed_key(5)).tolist() == jax.random.key_data(jax.random.key(5)).tolist()
    keys = [seed_key(s) for s in (0, 1, 2**32 - 1, 2**32, 2**33, 2**64, 2**200, -1, -2, -(2**63))]
    data = {tuple(jax.random.key_data(k).tolist()) for k in keys}
    assert len(data) == len(keys)  # distinct seeds, distinct keys (jax alone folds 2**32 onto 0)
    checked = generate.validate(["--seed", str(2**80)])
    assert checked.kwargs["seed"] == 2**80


def test_shipped_scheduler_keeps_what_the_model_was_trained_for():
    raw = json.loads((DIGITS / "scheduler" / "scheduler_config.json").read_text())
    assert raw["clip_sample"] is False and raw["prediction_type"] == "epsilon"
    swapped = eqxdiff.load_pipeline("digits", scheduler="ddim").scheduler
    assert swapped.config.clip_sample is False and swapped.config.set_alpha_to_one is False
    ddpm = eqxdiff.load_pipeline("digits", scheduler="ddpm").scheduler  # variance_type=None in the file
    state = ddpm.init(4, sample_shape=(1, 4, 4, 4))
    assert ddpm.remaining_steps(state) == 4 and ddpm.config.clip_sample is False


# -- what needs a compiled program: one, shared ---------------------------------------------------------------------

GENERATED = ["--steps", "2", "--seed", "3", "--scheduler", "ddim", "--scheduler-option", "timestep_spacing=trailing",
             "--vae-tiling", "--no-progress"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("generated")
    argv = [*GENERATED, "--output-dir", str(out)]
    return out, argv, generate.main(argv)


def test_outputs_record_what_was_used(generated):
    out, _, paths = generated
    params = read_parameters(paths[0])
    assert (params["height"], params["width"]) == (16, 16)
    assert params["scheduler"] == "ddim" and params["scheduler_options"] == {"timestep_spacing": "trailing"}
    assert "strength" not in params  # text-to-image: no strength recorded
    assert params["vae_tiling"] is True


def _no_denoising(self, denoiser, scheduler, state, latents, *args, **kwargs):
    return latents


def test_image_to_image_records_its_strength(generated, ws, tmp_path, monkeypatch):
    """The PNG of an image-to-image run records its strength (and the input file). The denoising loop is left out
    (the noised image latents are decoded as they are): what is recorded does not depend on it, and the loop of
    an image-to-image call would compile again."""
    from eqxdiff.pipelines import _latents

    monkeypatch.setattr(_latents.LatentPipeline, "run_loop", _no_denoising)
    paths = generate.main([*GENERATED, "--image", ws.paths["square"], "--strength", "0.5", "--output-dir",
                           str(tmp_path)])
    params = read_parameters(paths[0])
    assert params["strength"] == 0.5 and params["image"] == ws.paths["square"]
    assert (params["height"], params["width"]) == (16, 16)  # the input image's size


def test_an_unusable_cache_folder_is_one_warning_and_the_command_runs_uncached(generated, ws, unchanged, tmp_path,
                                                                              monkeypatch, capsys):
    """A --compilation-cache-dir that is a file, lies under a file or cannot be written in (the probe write made to
    fail: the tests run as root, whom a chmod does not stop) is one warning line; the command generates without the
    persistent cache (JAX's settings untouched) and exits normally."""
    from eqxdiff.core import _cache

    taken, locked = ws.paths["taken"], tmp_path / "locked"
    real_probe = _cache.write_probe

    def probe(folder):
        if folder == locked:
            raise PermissionError(13, "Permission denied")
        real_probe(folder)

    monkeypatch.setattr(_cache, "write_probe", probe)
    before = jax.config.jax_compilation_cache_dir  # the caller's (the test session's), left as it was
    seen, real_load = [], generate.load_pipeline
    monkeypatch.setattr(generate, "load_pipeline", lambda *a, **k: seen.append(jax.config.jax_compilation_cache_dir)
                        or real_load(*a, **k))
    cases = [(taken, "is a file"), (f"{taken}/cache", f"lies under '{taken}', which is a file"),
             (str(locked), r"cannot be written in \(PermissionError: Permission denied\)")]
    for i, (folder, problem) in enumerate(cases):
        out = tmp_path / f"out{i}"
        monkeypatch.setattr(sys, "argv", ["eqxdiff-generate", *GENERATED, "--output-dir", str(out),
                                          "--compilation-cache-dir", folder])
        generate.cli()  # no SystemExit: it ran
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert re.fullmatch(rf"warning: the compilation cache folder '{re.escape(folder)}' {problem}; running without "
                            r"the persistent compilation cache, so every program compiles \(pass "
                            r"--compilation-cache-dir with a folder you can write in, or --no-compilation-cache\)",
                            lines[0]), lines
        assert sum(line.startswith("warning:") for line in lines) == 1 and lines[-1].startswith("load:"), lines
        assert captured.out.split() == [str(out / "image_0.png")]
    assert seen == [before] * len(cases)  # no cache folder of the command's: JAX's settings untouched
    assert jax.config.jax_compilation_cache_dir == before


def test_nan_from_the_model_is_an_error_and_writes_nothing(generated, pipe, monkeypatch, capsys):
    out, argv, _ = generated
    bad_vae = eqx.tree_at(lambda v: v.decoder.conv_out.bias, pipe.vae,
                          jax.numpy.full_like(pipe.vae.decoder.conv_out.bias, np.nan))
    real_load = generate.load_pipeline

    def load_with_nan(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        return type(loaded).from_pipe(loaded, vae=bad_vae)

    monkeypatch.setattr(generate, "load_pipeline", load_with_nan)
    before = snapshot(out)
    monkeypatch.setattr(sys, "argv", ["eqxdiff-generate", *argv])
    with pytest.raises(SystemExit) as info:
        generate.cli()
    lines = capsys.readouterr().err.splitlines()
    assert info.value.code == 1 and lines == ["error: the model produced NaN or infinite values in 1 of 1 images; "
                                              "check the weights (a NaN in the checkpoint?) or lower guidance_scale "
                                              "(now 4)"], lines
    assert snapshot(out) == before


def test_nan_in_half_precision_says_to_run_in_float32(pipe):
    """Non-finite final latents of a bfloat16 run: the hint is the overflow of half-precision activations (and the
    guidance), not the checkpoint. (Checked on the latents the loop hands over: nothing compiles.)"""
    half = copy.copy(pipe)
    half.activations_dtype = jax.numpy.dtype("bfloat16")
    latents = jax.numpy.full((2, 4, 4, 4), jax.numpy.nan, jax.numpy.bfloat16).at[0].set(0.0)
    with pytest.raises(NonFiniteError, match=r"^the model produced NaN or infinite values in 1 of 2 latents; the "
                       r"bfloat16 activations may have overflowed: run in float32 \(activations_dtype, "
                       r"--activations-dtype/--weights-dtype float32\) or lower guidance_scale \(now 7.5\)$"):
        half.finish(latents, "latent", guided_by="guidance_scale (now 7.5)")
    with pytest.raises(NonFiniteError, match=r"in 1 of 2 latents; check the weights \(a NaN in the checkpoint\?\)$"):
        pipe.finish(latents.astype(jax.numpy.float32), "latent")


def test_shipped_model_untouched_by_everything_above():
    index = json.loads((DIGITS / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert not list(DIGITS.parent.glob(".digits.*"))  # no temporary folders beside it
    shutil.disk_usage(DIGITS)  # still there
