"""Bad training inputs are refused before anything loads, in one line naming the setting and the fix: through
``eqxdiff-train`` (``validate`` and the console command) and through ``eqxdiff.train.run``, whose model building is
replaced by a failure here (``build``), so a check that comes only after loading fails the test.

The pipeline folders hold configs only (a Wan 2.1-style text-to-video folder and a Stable Diffusion folder, their
``model_index.json`` and each component's config, no weights): everything here is read from them, never loaded.
"""

import dataclasses
import json
import shutil
import sys

import diffusers
import numpy as np
import pytest
from PIL import Image

from eqxdiff.cli import train as train_cli
from eqxdiff.data import DataError, FrameSampling, character_tokenizer
from eqxdiff.pipelines import InputError, write_video
from eqxdiff.train import LoraConfig, Objective, TrainConfig, run
from eqxdiff.train import _run as run_module
from eqxdiff.train._sources import open_source, stream

from . import _tiny_sd, _tiny_wan


def _configs_only(folder, class_name: str, components: dict, **settings) -> str:
    """A pipeline folder of ``components`` (``{name: diffusers object}``) saved as configs only."""
    index = {"_class_name": class_name, "_diffusers_version": diffusers.__version__, **settings}
    for name, component in components.items():
        component.save_config(folder / name)
        index[name] = ["diffusers", type(component).__name__]
    (folder / "model_index.json").write_text(json.dumps(index))
    return str(folder)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_train")
    wan = _configs_only(root / "wan", "WanPipeline", {
        "transformer": diffusers.WanTransformer3DModel(**_tiny_wan.T2V_PIPELINE),
        "vae": diffusers.AutoencoderKLWan(**_tiny_wan.VAE_21), "scheduler": _tiny_wan.scheduler()},
        transformer_2=[None, None], boundary_ratio=None, expand_timesteps=False)
    experts = {}
    for name, ratio in (("experts_apart", 1.5), ("experts_unsplit", None)):  # two experts, a boundary that is not one
        shutil.copytree(wan, root / name)
        index = json.loads((root / name / "model_index.json").read_text())
        index.update(transformer_2=index["transformer"], boundary_ratio=ratio)
        (root / name / "model_index.json").write_text(json.dumps(index))
        experts[name] = str(root / name)
    sd = _tiny_sd.build_pipeline(root / "sd_full")  # its configs only, below
    sd_folder = _configs_only(root / "sd", "StableDiffusionPipeline", {
        "unet": sd.unet, "vae": sd.vae, "scheduler": sd.scheduler})
    clips, images = root / "clips", root / "images"
    clips.mkdir()
    images.mkdir()
    frames = np.clip(np.arange(12)[:, None, None, None] * 20 + np.zeros((1, 16, 16, 3)), 0, 255).astype(np.uint8)
    for i in range(4):
        write_video(frames, clips / f"{i}.mp4", fps=8)
        (clips / f"{i}.txt").write_text("a grey clip")
        Image.fromarray(frames[i]).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text("a grey square")
    return {**experts, "wan": wan, "sd": sd_folder, "clips": str(clips), "images": str(images),
            "out": str(root / "out")}


def _wan(ws, *flags, data="clips"):
    return ["wan2.1-1.3b", "--model", ws["wan"], "--data", ws[data], "--resolution", "16", "--frames.count", "9",
            "--output-dir", ws["out"], *flags]


def _sd(ws, *flags, data="images", preset="sd15", model="sd"):
    return [preset, "--model", ws[model], "--data", ws[data], "--resolution", "16", "--output-dir", ws["out"], *flags]


FLOW_SCHEDULERS = r"\['dpm\+\+2m', 'flow_euler', 'unipc'\]"
CLI = [  # (id, argv of ws, error, match)
    ("image-preset-on-a-video-folder", lambda ws: _sd(ws, data="clips", model="wan"), InputError,
     r"^--objective.snr-gamma 5.0: snr_gamma and timestep_bias weight the DDPM process, but the model trains by flow "
     r"matching, .*; or start from a preset of the model's family \(wan2.1-1.3b, wan2.1-14b, wan2.2-a14b, "
     r"wan2.2-ti2v-5b\) with --model$"),
    ("images-for-a-video-model", lambda ws: _wan(ws, data="images"), InputError, r"^--model '.*wan' trains "
     r"WanFlowMatching on video clips, but --data '.*images' holds images: give a folder of clips \(.mp4, "),
    ("clips-for-an-image-model", lambda ws: _sd(ws, data="clips"), InputError, r"^--data '.*clips' holds video "
     r"clips, but --model '.*sd' trains LatentDiffusion on images: give a folder of images"),
    ("synthetic-images-for-a-video-model", lambda ws: [*_wan(ws)[:4], "synthetic", *_wan(ws)[5:]], InputError,
     r"^--model '.*wan' trains WanFlowMatching on video clips, but the synthetic source holds images"),
    ("ddpm-target-on-flow", lambda ws: _wan(ws, "--objective.prediction-type", "epsilon"), InputError,
     r"^--objective.prediction-type 'epsilon' is a DDPM target; the model trains by flow matching, which predicts "
     r"the velocity: set --objective.prediction-type 'flow_prediction' or leave it out$"),
    ("min-snr-on-flow", lambda ws: _wan(ws, "--objective.snr-gamma", "5"), InputError, r"^--objective.snr-gamma "
     r"5.0: snr_gamma and timestep_bias weight the DDPM process, but the model trains by flow matching, which takes "
     r"weighting_scheme \(one of \['none', .*\]\): leave them out$"),
    ("flow-weighting-on-ddpm", lambda ws: _sd(ws, "--objective.weighting-scheme", "logit_normal"), InputError,
     r"^DDPMScheduler trains on the DDPM process, where --objective.weighting-scheme 'logit_normal' \(flow "
     r"matching's\) does not apply: leave it out"),
    ("ddpm-scheduler-config-on-flow", lambda ws: _wan(ws, "--export-scheduler", "ddim"), InputError,
     r"^--export-scheduler 'ddim' cannot sample the model's noise schedule \(its config refuses a rectified-flow "
     rf"one\); choose one of {FLOW_SCHEDULERS} \(or None: the folder's scheduler\)$"),
    ("flow-scheduler-on-ddpm", lambda ws: _sd(ws, "--export-scheduler", "flow_euler"), InputError,
     r"^--export-scheduler 'flow_euler' \(FlowMatchEulerDiscreteScheduler\) samples rectified flow, but the model "
     r"trains on the DDPM noise process"),
    ("prior-preservation-of-video", lambda ws: _wan(ws, "--class-prompt", "a clip"), InputError, r"^--class-prompt "
     r"'a clip' asks for prior preservation, whose class images the model draws, but WanFlowMatching trains on "
     r"video clips"),
    ("expert-boundary-outside", lambda ws: ["wan2.2-a14b", "--model", ws["experts_apart"], *_wan(ws)[3:]],
     InputError, r"^the folder's boundary_ratio=1.5 must be in \(0, 1\): the experts split the timesteps there, and "
     r"outside it one of them trains on none \(Wan 2.2 A14B's is 0.875\); fix the folder's model_index.json$"),
    ("two-experts-without-boundary", lambda ws: [*_wan(ws, "--family.expert", "high")[:2], ws["experts_unsplit"],
                                                 *_wan(ws, "--family.expert", "high")[3:]], InputError,
     r"^a Wan folder with transformer_2 needs boundary_ratio .*: got transformer_2 present, boundary_ratio=None; fix "
     r"the folder's model_index.json$"),
    ("frames-for-an-image-model", lambda ws: _sd(ws, "--frames.count", "9", "--frames.stride", "2"), InputError,
     r"^--frames.count 9, --frames.stride 2 pick the frames of video clips, but LatentDiffusion trains on images: "
     r"leave them out$"),
    ("fewer-steps-than-accumulation", lambda ws: _sd(ws, "--steps", "3"), InputError, r"^--steps 3 is fewer than "
     r"--optimizer.accumulation-steps 4: no optimizer update would run \(the export would be the model as loaded\); "
     r"give --steps 4 or more \(a multiple of 4\), or fewer accumulation steps$"),
    ("lora-flag-on-a-full-fine-tune", lambda ws: _sd(ws, "--lora.alpha", "8", "--lora.dora"), ValueError,
     r"^--lora.alpha 8.0, --lora.dora True set LoRA adapters, but --lora.rank 0 trains the whole denoiser without "
     r"any: give --lora.rank 4 \(or another rank > 0\) for a LoRA, or drop them$"),
    ("remat-names-without-named-remat", lambda ws: _sd(ws, "--remat", "FULL", "--remat-names", "resnet"),
     ValueError, r"^--remat-names \('resnet',\) are kept by remat 'named' / 'offload_named', but --remat 'full' "
     r"keeps none: use --remat 'named' \(or 'offload_named'\) with them, or drop them$"),
    ("from-scratch-flags-on-a-fine-tune", lambda ws: _sd(ws, "--architecture.image-size", "32", "--kl-weight",
                                                         "0.1"), ValueError,
     r"^--architecture.image-size 32, --kl-weight 0.1 set the from-scratch digits architecture and its autoencoder "
     r"stage, but --model '.*sd' is fine-tuned as it is: drop them"),
]


def _must_not_load(*args, **kwargs):
    raise AssertionError("a bad input must be refused before anything is loaded")


@pytest.mark.parametrize(("argv", "error", "match"), [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_eqxdiff_train_refuses_before_loading(argv, error, match, ws, capsys, monkeypatch):
    monkeypatch.setattr(train_cli, "run", _must_not_load)
    argv = argv(ws)
    with pytest.raises(error, match=match) as info:
        train_cli.validate(argv)
    assert "\n" not in str(info.value)
    monkeypatch.setattr(sys, "argv", ["eqxdiff-train", *argv])
    with pytest.raises(SystemExit) as exit_info:
        train_cli.cli()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {info.value}"]


def test_a_lora_preset_trains_in_full_with_rank_0(ws):
    """``lora-flux --lora.rank 0``: the preset's adapter settings (its targets) go with its rank, so nothing is
    refused; a LoRA flag given beside the rank 0 still is."""
    argv = ["lora-flux", "--data", ws["images"], "--output-dir", ws["out"]]
    assert train_cli.validate([*argv, "--lora.rank", "0"]).lora == LoraConfig()
    assert train_cli.validate([*argv, "--lora.rank=0"]).lora == LoraConfig()
    with pytest.raises(ValueError, match=r"^--lora.targets \('mlp',\) sets LoRA adapters, but --lora.rank 0"):
        train_cli.validate([*argv, "--lora.rank", "0", "--lora.targets", "mlp"])


def test_steps_past_the_last_update_are_noted(ws, monkeypatch, capsys):
    """sd15 accumulates 4 micro-steps per update: --steps 10 leaves 2 whose gradient no update applies."""
    monkeypatch.setattr(train_cli, "run", lambda config: None)
    train_cli.main(_sd(ws, "--steps", "10"))
    assert capsys.readouterr().err.splitlines() == [
        "note: --steps 10 is not a multiple of --optimizer.accumulation-steps 4: the last 2 micro-step(s) accumulate "
        "a gradient that no update applies"]


def test_a_batch_the_mesh_cannot_split_names_the_flag(ws, monkeypatch, capsys):
    monkeypatch.setattr(run_module, "build", _must_not_load)
    monkeypatch.setattr(sys, "argv", ["eqxdiff-train", *_wan(ws, "--batch-size", "3")])
    with pytest.raises(SystemExit):
        train_cli.cli()
    assert capsys.readouterr().err.splitlines() == [
        "error: --batch-size 3 must be a multiple of 8: the mesh {'data': 1, 'fsdp': 8, 'context': 1, 'tensor': 1} "
        "splits each batch over its data x fsdp axes; use --batch-size 8 (or another multiple of 8), or change the "
        "mesh's data/fsdp parallelism"]


@pytest.mark.parametrize(("argv", "message"), [
    (lambda ws: _sd(ws, "--caption-column", "prompt", "--batch-size", "8", "--mesh.ici-data-parallelism", "8"),
     "--caption-column 'prompt' names a field of a metadata.jsonl / metadata.csv, but {images} reads none (a .txt "
     "caption beside each image): add such a file, or leave it out"),
    (lambda ws: _wan(ws, "--caption-column", "prompt", "--image-column", "clip", "--batch-size", "8"),
     "--caption-column 'prompt', video_column='clip' name a field of a metadata.jsonl / metadata.csv, but {clips} "
     "reads none (a .txt caption beside each clip): add such a file, or leave them out"),
    (lambda ws: [*_sd(ws)[:4], ws["images"] + "/gone", *_sd(ws, "--batch-size", "8")[5:]],
     "--data '{images}/gone' names no folder: give 'digits', 'synthetic' or a folder of images or clips with "
     "captions; for a Hugging Face dataset (a Hub id, parquet, json, csv or arrow files) use --hf-dataset")],
    ids=["caption-column-without-metadata", "columns-without-metadata-of-clips", "data-folder-missing"])
def test_data_flags_the_data_cannot_take_are_refused_before_loading(argv, message, ws, monkeypatch, capsys):
    """Metadata columns given for a folder captioned by .txt files were dropped without a word; a --data path that
    does not exist said it was no image folder."""
    monkeypatch.setattr(run_module, "build", _must_not_load)
    monkeypatch.setattr(sys, "argv", ["eqxdiff-train", *argv(ws)])
    with pytest.raises(SystemExit):
        train_cli.cli()
    assert capsys.readouterr().err.splitlines() == [f"error: {message.format(**ws)}"]


def _library(ws, tmp_path, model="wan", data="clips", **changes) -> TrainConfig:
    return TrainConfig(**{**dict(model=ws[model], data=ws[data], resolution=16, batch_size=2, steps=1,
                                 frames=FrameSampling(count=9), output_dir=tmp_path, export_scheduler=None,
                                 progress=False), **changes})


def test_run_refuses_before_loading(ws, tmp_path, monkeypatch):
    """The same checks in ``eqxdiff.train.run``, before it builds the model (an hf_dataset of images for a video
    model: once it is opened); nothing is written."""
    import datasets

    monkeypatch.setattr(run_module, "build", _must_not_load)
    rows = {"image": [f"{ws['images']}/{i}.png" for i in range(4)], "text": ["a grey square"] * 4}
    parquet = tmp_path / "images.parquet"
    datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image()).to_parquet(str(parquet))
    cases = [
        (dict(data=ws["images"]), DataError, r"^model='.*wan' trains WanFlowMatching on video clips, but "
                                             r"data='.*images' holds images"),
        (dict(data=None, hf_dataset=str(parquet)), DataError, r"^model='.*wan' trains WanFlowMatching on video "
                                                             r"clips, but hf_dataset='.*images.parquet' holds images"),
        (dict(objective=Objective(prediction_type="v_prediction")), ValueError, r"^prediction_type='v_prediction' is "
                                                                                r"a DDPM target"),
        (dict(frames=FrameSampling(count=8)), ValueError, r"^frames.count=8 must be 1 \+ 4k \(the VAE keeps the first "
                                                          r"frame .*\); try frames.count=5 or 9$"),
        (dict(resolution=(16, 24)), ValueError, r"^resolution=\(16, 24\) must be height and width multiples of 16 "
                                                r"\(the VAE downsamples by 8 and the transformer takes 2x2 patches\); "
                                                r"try resolution=\(16, 16\)$"),
        (dict(model=ws["sd"], data=ws["images"], frames=FrameSampling(), resolution=17), ValueError,
         r"^resolution=17 must be a multiple of 2 \(the VAE downsamples by 2\); try resolution=16$"),
        (dict(export_scheduler="ddim"), ValueError, r"^export_scheduler='ddim' cannot sample the model's noise"),
        (dict(class_prompt="a clip"), ValueError, r"^class_prompt='a clip' asks for prior preservation"),
        (dict(model=ws["sd"], data=ws["images"]), ValueError, r"^frames.count=9 picks the frames of video clips, but "
                                                              r"LatentDiffusion trains on images: leave it out$"),
        (dict(model=ws["sd"], frames=FrameSampling()), DataError, r"^data='.*clips' holds video clips, but "
                                                                  r"model='.*sd' trains LatentDiffusion on images"),
    ]
    out = tmp_path / "run"
    for changes, error, match in cases:
        with pytest.raises(error, match=match):
            run(dataclasses.replace(_library(ws, out), **changes))
        assert not (out / "config.json").exists() and not (out / "checkpoints").exists()


def test_an_instance_prompt_captions_clips(ws, tmp_path):
    """DreamBooth's ``instance_prompt`` on a folder of clips: the clips train with the prompt (their records go
    through the clip transform, not the image one)."""
    config = _library(ws, tmp_path, instance_prompt="a sks clip")
    tokenizer = character_tokenizer(max_length=16)
    batch = next(iter(stream(config, open_source(config)[1], tokenizer)))
    assert batch["pixel_values"].shape == (2, 9, 16, 16, 3)
    expected = tokenizer(["a sks clip"], padding="max_length", max_length=16, return_tensors="np").input_ids
    np.testing.assert_array_equal(batch["input_ids"], np.repeat(expected, 2, axis=0))
