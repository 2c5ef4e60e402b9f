"""``eqxdiff.train.run`` end to end on the tiny digits architecture: from each data source (image folder, Hugging
Face parquet, TFRecord, synthetic) on the mesh, resuming exactly (from a checkpoint, after SIGINT / SIGTERM, onto the
mesh), the settings saved with a checkpoint deciding what a resume may change, a finished run with nothing to do, a
run that starts over, the autoencoder stage (reused, refused, stopped, its progress bar), fine-tuning the shipped
digits model, and the run's config errors.

Every run steps with the program that tests/test_train.py's test_sharded_step_equals_single_device[fsdp+data] (on
the mesh) or its single-device tests compile (same model, plan, optimizer, objective and batch layout: one compile
per session when that module runs first); the autoencoder stage is skipped by handing each run the same saved VAE
(a resumed run reuses it the same way)."""

import dataclasses
import json
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxdiff
from eqxdiff.data import character_tokenizer
from eqxdiff.train import (
    ArrayBatches,
    CheckpointMismatchError,
    DataError,
    Objective,
    OptimizerConfig,
    TrainConfig,
    TrainingInterrupted,
    run,
)
from eqxdiff.train import _autoencoder as autoencoder_module
from eqxdiff.train import _run as run_module
from eqxdiff.train import _setup as train_setup
from eqxdiff.train._checkpoint import saved_settings, saved_steps
from eqxdiff.train._config import run_settings
from eqxdiff.train._resume import autoencoder_reuse, record_autoencoder

from ._tiny_train import OPT, RUN, TINY, tiny_model
from ._util import assert_close_to_float64

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255), "black": (0, 0, 0),
          "yellow": (255, 255, 0), "cyan": (0, 255, 255), "magenta": (255, 0, 255)}


@pytest.fixture(scope="module")
def tiny():
    """:func:`tests._tiny_train.tiny_model`: RUN's model, its samples, and the samples encoded."""
    return tiny_model()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same 8 solid-colour images, captioned ``a {colour} square``, as an image folder (.txt captions), a parquet
    file read by Hugging Face ``datasets`` (columns ``img``/``caption``) and TFRecord shards (features
    ``png``/``prompt``); and a saved autoencoder for the runs to reuse."""
    from PIL import Image

    from eqxdiff.data import write_tfrecord
    from eqxdiff.loading import save_pretrained
    from eqxdiff.train._setup import build_model

    root = tmp_path_factory.mktemp("sources")
    folder = root / "folder"
    folder.mkdir()
    pngs = []
    for i, (name, rgb) in enumerate(COLORS.items()):
        Image.new("RGB", (10 + i, 12), rgb).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"a {name} square")
        pngs.append(((folder / f"{name}.png").read_bytes(), f"a {name} square"))
    write_tfrecord(root / "a.tfrecord", pngs[:5], image_key="png", caption_key="prompt")
    write_tfrecord(root / "b.tfrecord", pngs[5:], image_key="png", caption_key="prompt")
    try:  # only the Hugging Face runs need `datasets` (the "data" extra); the other sources run without it
        import datasets
    except ImportError:
        parquet = None
    else:
        parquet = root / "data.parquet"
        ds = datasets.Dataset.from_dict({"img": [str(folder / f"{c}.png") for c in COLORS],
                                         "caption": [f"a {c} square" for c in COLORS]})
        ds.cast_column("img", datasets.Image()).to_parquet(str(parquet))
    model, _, _ = build_model(RUN)
    save_pretrained(model.vae, root / "autoencoder")
    return {"folder": folder, "parquet": parquet, "tfrecord": (str(root / "a.tfrecord"),
            str(root / "b.tfrecord")), "autoencoder": root / "autoencoder"}


def _config(out, **changes):
    return dataclasses.replace(RUN, output_dir=out, **changes)


def _run(sources, out, **changes):
    if not (out / "autoencoder").exists():
        shutil.copytree(sources["autoencoder"], out / "autoencoder")
    return run(_config(out, **changes))


def _files(folder) -> dict:
    """Every file under ``folder`` with its bytes."""
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _must_not_build(*args, **kwargs):
    raise AssertionError("built the model: the run should have stopped before")


def _check_run(out, result, steps, mesh_size=8):
    import json

    state, _, losses = result
    assert int(state.step) == steps and len(losses) >= 1 and all(np.isfinite(losses))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == steps and rows[-1]["loss"] == losses[-1]
    assert (out / "pipeline" / "model_index.json").is_file()
    scheduler = json.loads((out / "pipeline" / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["clip_sample"] is False and scheduler["set_alpha_to_one"] is False  # what DDIM/DDPM would read
    params = jax.tree.leaves(state.params)
    assert all(len(x.sharding.device_set) == mesh_size for x in params)
    if mesh_size > 1:
        assert any(not x.sharding.is_fully_replicated for x in params)  # split over fsdp


def _captions(tok, ids):
    return sorted(tok.batch_decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("source", ["folder", "hf", "tfrecord"])
def test_run_from_each_source(sources, tmp_path, source):
    """The flags of each source select it (the first batch holds its images under their captions) and ``run``
    trains on it end to end on the mesh."""
    from eqxdiff.train import load_data

    if source == "hf" and sources["parquet"] is None:
        pytest.skip("Hugging Face datasets is not installed (pip install -e '.[data]')")
    changes = {"folder": dict(data=str(sources["folder"])),
               "hf": dict(hf_dataset=str(sources["parquet"]), image_column="img", caption_column="caption"),
               "tfrecord": dict(tfrecord=sources["tfrecord"], image_key="png", caption_key="prompt")}[source]
    tok = character_tokenizer(max_length=32)
    kind, ds = load_data(dataclasses.replace(RUN, **changes), tok)
    batch = next(iter(ds))
    assert kind == "stream" and batch["pixel_values"].shape == (8, 8, 8, 3)
    captions = [c.replace(" ", "") for c in tok.batch_decode(batch["input_ids"], skip_special_tokens=True)]
    assert sorted(captions) == sorted(f"a{c}square" for c in COLORS)
    for image, caption in zip(batch["pixel_values"], captions):
        color = np.array(COLORS[caption[1:-6]])  # the pipeline's float32 u / 127.5 - 1, rounded as NumPy's is
        assert_close_to_float64(image[0, 0], color.astype(np.float32) / np.float32(127.5) - np.float32(1),
                                color / 127.5 - 1, what=caption)
    _check_run(tmp_path, _run(sources, tmp_path, **changes), steps=1)


def test_run_synthetic_resumes_exactly(sources, tmp_path, capsys):
    """Synthetic data on one device (the program the single-device tests compiled): 2 steps straight == 1 step, a
    checkpoint, then a resumed run of 1 more (the grain iterator's position and the state come back from it); then
    a run that starts over (``resume=False``) in the same folder."""
    one = dict(data="synthetic", mesh=None)
    straight = _run(sources, tmp_path / "a", steps=2, **one)
    _check_run(tmp_path / "a", straight, steps=2, mesh_size=1)
    first = _run(sources, tmp_path / "b", steps=1, checkpoint_every=1, **one)
    second = _run(sources, tmp_path / "b", steps=2, checkpoint_every=1, **one)
    assert first[2] + second[2] == straight[2]
    for a, b in zip(jax.tree.leaves(second[0].params), jax.tree.leaves(straight[0].params)):
        np.testing.assert_array_equal(a, b)
    # resume=False starts over: the earlier run's checkpoints 1 and 2 make way for its own (orbax writes no step
    # below the latest: they once stayed, and a later resume went on from the earlier run's step 2).
    capsys.readouterr()
    again = _run(sources, tmp_path / "b", steps=1, checkpoint_every=1, resume=False, **one)
    assert again[2] == first[2] and saved_steps(tmp_path / "b" / "checkpoints") == [1]
    assert f"note: resume=False: removed the earlier run's checkpoints [1, 2] in {tmp_path / 'b' / 'checkpoints'}" \
        in capsys.readouterr().out


@pytest.fixture
def sigterm_raises():
    """While the test runs, a SIGTERM that reaches the process's handler raises (instead of killing pytest): a loop
    that failed to catch it fails the test. The test's own handler is put back after it (checked by the tests)."""

    class Unhandled(Exception):
        pass

    def handler(signum, frame):
        raise Unhandled("SIGTERM was not caught by the loop")

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_and_the_run_resumes_exactly(sources, tmp_path, monkeypatch, sigterm_raises,
                                                                 signum, capsys):
    """A real SIGINT (Ctrl-C) or SIGTERM (what Slurm or Kubernetes send before a kill) during step 1 of 2 (sent
    from the metrics logger) stops the run at the step boundary with a saved checkpoint (no checkpoint_every
    needed) and TrainingInterrupted. Resumed with another learning rate, it is refused before anything is built,
    by the settings saved with the checkpoint. Resumed with the same settings (and another log_every: a setting that
    may change, noted), it ends where an uninterrupted run ends, loss for loss and weight for weight, and says which
    steps it trained. Finished, it holds a checkpoint of step 2 and the same call has nothing to do. The runs reuse
    the module's compiled step."""
    from eqxdiff.train._metrics import MetricsLogger

    one = dict(data="synthetic", mesh=None, steps=2)
    straight = _run(sources, tmp_path / "a", **one)
    log = MetricsLogger.log
    handler = signal.getsignal(signum)

    def log_then_interrupt(self, step, row):
        log(self, step, row)
        if step == 1:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(MetricsLogger, "log", log_then_interrupt)
    with pytest.raises(TrainingInterrupted, match="interrupted at step 1; checkpoint saved in") as stopped:
        _run(sources, tmp_path / "b", **one)
    assert stopped.value.step == 1 and (tmp_path / "b" / "checkpoints" / "1").is_dir()
    assert signal.getsignal(signum) is handler  # the handler was put back
    monkeypatch.setattr(MetricsLogger, "log", log)
    assert saved_settings(tmp_path / "b" / "checkpoints", 1) == run_settings(_config(tmp_path / "b", **one))
    before = _files(tmp_path / "b")
    monkeypatch.setattr(run_module, "build", _must_not_build)
    with pytest.raises(CheckpointMismatchError, match=rf"^cannot resume from {tmp_path}/b/checkpoints/1, trained "
                       r"with other settings: optimizer.learning_rate=1.0 -> 0.5; give its settings to resume, "
                       r"resume=False to start over \(replacing its checkpoints\), or output_dir=<another folder>$"):
        _run(sources, tmp_path / "b", optimizer=dataclasses.replace(OPT, learning_rate=0.5), **one)
    assert _files(tmp_path / "b") == before
    monkeypatch.undo()  # the logger and build as they are
    capsys.readouterr()
    resumed = _run(sources, tmp_path / "b", **dict(one, log_every=2))
    assert resumed[2] == straight[2][1:]
    for a, b in zip(jax.tree.leaves(resumed[0].params), jax.tree.leaves(straight[0].params)):
        np.testing.assert_array_equal(a, b)
    out = capsys.readouterr().out
    assert f"] note: resuming from {tmp_path}/b/checkpoints/1 with settings that may change on resume: " \
           "log_every=1 -> 2\n" in out
    assert "] trained steps 1-2 in " in out, out
    assert saved_steps(tmp_path / "b" / "checkpoints") == [1, 2]  # the finished state too
    monkeypatch.setattr(run_module, "build", _must_not_build)
    assert _run(sources, tmp_path / "b", **dict(one, log_every=2)) == (None, None, [])
    assert f"] already trained to step 2 ({tmp_path}/b/checkpoints/2); nothing to do\n" in capsys.readouterr().out


def test_resume_with_another_architecture_refuses_before_restoring(sources, tmp_path, monkeypatch):
    """A checkpoint of one architecture is not resumed by another: refused before anything is built, from the
    settings saved with it, with nothing written. A checkpoint saved without its settings (by eqxdiff before they
    were) is refused when its arrays do not fit, with the list of them and of the settings that differ from the
    run's config.json, which stays as it was."""
    one = dict(data="synthetic", mesh=None, steps=1, checkpoint_every=1)
    _run(sources, tmp_path, **one)
    saved, before = (tmp_path / "config.json").read_text(), _files(tmp_path)
    wider = dataclasses.replace(TINY, unet_channels=(16,))
    monkeypatch.setattr(run_module, "build", _must_not_build)
    with pytest.raises(CheckpointMismatchError, match=r"^cannot resume from .*checkpoints/1, trained with other "
                       r"settings: architecture.unet_channels=\[8\] -> \[16\]; give its settings to resume"):
        _run(sources, tmp_path, architecture=wider, **dict(one, steps=2))
    assert _files(tmp_path) == before
    monkeypatch.undo()
    shutil.rmtree(tmp_path / "checkpoints" / "1" / "settings")
    with pytest.raises(CheckpointMismatchError, match=r"(?s)checkpoint 1 in .* was written by a different model .*"
                       r"nothing was restored.\nSettings that differ from that run's config.json: "
                       r"architecture\.unet_channels=\[8\] -> \[16\]\nArrays that differ:.*"
                       r"conv_in\.bias: \[8\] float32 in the checkpoint, \[16\] float32 in this run"):
        _run(sources, tmp_path, architecture=wider, **dict(one, steps=2))
    assert (tmp_path / "config.json").read_text() == saved


def test_resume_with_another_autoencoder_refuses_before_reusing_it(sources, tmp_path):
    """OUTPUT_DIR/autoencoder is reused only by a run whose VAE settings are those recorded beside it by the run that
    trained it, whatever a later run wrote into config.json: a changed VAE architecture (or KL weight, autoencoder
    steps ...) is refused with the list of what differs, before anything is written. A VAE saved without that record
    (by eqxdiff before it kept one) is compared with config.json. With resume=False the stage trains a new one in
    its place. Nothing compiles: the earlier runs are their files."""
    earlier = _config(tmp_path, data="synthetic", mesh=None)
    shutil.copytree(sources["autoencoder"], tmp_path / "autoencoder")
    (tmp_path / "config.json").write_text(json.dumps(run_settings(earlier), indent=2))
    before = _files(tmp_path)
    wider = dataclasses.replace(TINY, vae_channels=(8, 16))
    refused = (r"^the autoencoder in .*autoencoder was trained with other settings: architecture.vae_channels=\[8, "
               r"8\] -> \[8, 16\], kl_weight=0.0001 -> 0.001; nothing was changed. Give its settings to reuse it, "
               r"resume=False to train a new one in its place, or output_dir=<another folder>$")
    with pytest.raises(CheckpointMismatchError, match=refused):
        run(dataclasses.replace(earlier, architecture=wider, kl_weight=1e-3, steps=2))
    assert _files(tmp_path) == before
    # Recorded beside the VAE: a config.json that a later run (kl_weight=1e-3) rewrote does not decide.
    record_autoencoder(earlier, tmp_path / "autoencoder")
    later = dataclasses.replace(earlier, kl_weight=1e-3)
    (tmp_path / "config.json").write_text(json.dumps(run_settings(later), indent=2))
    before = _files(tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"trained with other settings: kl_weight=0.0001 -> 0.001;"):
        run(later)
    assert _files(tmp_path) == before
    assert autoencoder_reuse(earlier) and not autoencoder_reuse(dataclasses.replace(later, resume=False))


def test_a_signal_stops_the_autoencoder_stage_and_keeps_nothing(tiny, tmp_path, monkeypatch, sigterm_raises):
    """SIGTERM during the autoencoder stage (sent from the stage's log line of step 1 of 3) stops it at the step
    boundary: TrainingInterrupted says that nothing of the stage was kept and how to start again, no autoencoder
    folder is written, and the handlers are put back. (The stage's step is a stand-in: the stopping is the loop's,
    and nothing needs to compile.)"""
    model, arrays, _ = tiny
    log = train_setup.log_line

    def log_then_terminate(message):
        log(message)
        if message.startswith("autoencoder step 1/"):
            os.kill(os.getpid(), signal.SIGTERM)

    steps = []

    def stand_in_step(carry, images, key, optimizer, kl_weight):
        steps.append(images.shape)
        return carry, jnp.float32(0.5)

    monkeypatch.setattr(train_setup, "log_line", log_then_terminate)
    monkeypatch.setattr(autoencoder_module, "_vae_step", stand_in_step)
    config = dataclasses.replace(RUN, output_dir=tmp_path, autoencoder_steps=3, autoencoder_batch_size=8)
    with pytest.raises(TrainingInterrupted, match=r"^autoencoder stage interrupted at step 1 of 3; nothing of it was "
                       r"kept \(run the same command to train it again from the start\)$") as stopped:
        train_setup.autoencoder_stage(config, model, "arrays", arrays)
    assert stopped.value.step == 1 and stopped.value.checkpoint is None and steps == [(8, 8, 8, 3)]
    assert not (tmp_path / "autoencoder").exists()
    assert signal.getsignal(signal.SIGTERM) is sigterm_raises


def test_the_autoencoder_stage_has_its_own_progress_bar(monkeypatch, capsys):
    """With ``progress``, the autoencoder stage's steps (which come before any training step) count up on a bar of
    their own, named. (A stand-in step: nothing compiles.)"""
    monkeypatch.setattr(autoencoder_module, "_vae_step", lambda carry, *args: (carry, jnp.float32(0.5)))
    batches = ArrayBatches({"pixel_values": np.zeros((4, 8, 8, 3), np.float32)}, 2)
    autoencoder_module.train_autoencoder(None, batches, steps=3, key=jax.random.key(0), progress=True,
                                         log=lambda *_: None)
    err = capsys.readouterr().err
    assert "autoencoder stage: 100%" in err and "3/3" in err, err


def test_fine_tune_the_shipped_digits_model(tmp_path):
    """``model="digits"``: the shipped pipeline (its scheduler config has ``variance_type: null``, which once crashed
    DDPMScheduler.from_config) fine-tuned for one step on synthetic images, exported, and the export loads with the
    trained weights. One compile of the digits UNet's step (cached latents: no VAE or text encoder in it)."""
    config = TrainConfig(model="digits", data="synthetic", resolution=16, batch_size=2, steps=1, mesh=None,
                         cache_stream=True, log_every=1, progress=False, output_dir=tmp_path,
                         optimizer=OptimizerConfig(total_steps=1))
    state, _, losses = run(config)
    assert int(state.step) == 1 and len(losses) == 1 and np.isfinite(losses[0])
    assert saved_steps(tmp_path / "checkpoints") == [1]  # no checkpoint_every: the finished run's only
    assert run(config) == (None, None, [])  # the same run again: nothing to do
    exported = eqxdiff.load_pipeline(tmp_path / "pipeline")
    shipped = eqxdiff.load_pipeline("digits")
    assert type(exported) is type(shipped) and type(exported.scheduler) is type(shipped.scheduler)
    assert exported.scheduler.config == shipped.scheduler.config
    # the export's recommended call is the run's sampling recipe (issue 18: folders carry their call defaults)
    assert exported.call_defaults == {"num_inference_steps": config.sample_steps,
                                      "guidance_scale": config.sample_guidance_scale}
    trained, original = exported.unet.conv_in.weight, shipped.unet.conv_in.weight
    assert trained.shape == original.shape and not np.array_equal(trained, original)
    np.testing.assert_array_equal(exported.vae.encoder.conv_in.weight, shipped.vae.encoder.conv_in.weight)


def test_run_resumes_on_the_mesh(sources, tmp_path, capsys):
    """A checkpoint saved on one device restores onto the mesh (the mesh may change on resume, with a note): the
    resumed run continues at the saved step, from the grain iterator's saved position, with every array on the
    sharding a fresh run on the mesh gives it."""
    tfrecord = dict(tfrecord=sources["tfrecord"], image_key="png", caption_key="prompt", checkpoint_every=1)
    first = _run(sources, tmp_path / "a", mesh=None, **tfrecord)
    capsys.readouterr()
    second = _run(sources, tmp_path / "a", steps=2, **tfrecord)
    assert (f"note: resuming from {tmp_path}/a/checkpoints/1 with settings that may change on resume: mesh=None -> "
            "{'ici_data_parallelism': 2, ... 8 keys}, steps=1 -> 2\n") in capsys.readouterr().out
    _check_run(tmp_path / "a", second, steps=2)
    assert len(second[2]) == 1 and second[2][0] != first[2][0]
    fresh = _run(sources, tmp_path / "b", **tfrecord)
    for a, b in zip(jax.tree.leaves(second[0]), jax.tree.leaves(fresh[0]), strict=True):
        assert a.sharding == b.sharding


def test_run_config_errors_name_the_flag(sources, tmp_path):
    from eqxdiff.parallel import Remat
    from eqxdiff.train import TrainConfig, load_data

    with pytest.raises(ValueError, match=r"give one data source, got data='synthetic' and hf_dataset='x'"):
        TrainConfig(data="synthetic", hf_dataset="x")
    with pytest.raises(ValueError, match=r"give one data source, got hf_dataset='x' and tfrecord=\('a',\)"):
        TrainConfig(hf_dataset="x", tfrecord=("a",))
    with pytest.raises(ValueError, match="fine-tuning needs training data: set one of data"):
        TrainConfig(model="some/model").source
    with pytest.raises(ValueError, match=r"caption_key='prompt' is for the tfrecord source.*'hf'; use caption_column"):
        TrainConfig(hf_dataset="x", caption_key="prompt")
    with pytest.raises(ValueError, match=r"image_column='img' is for an hf_dataset or an image folder.*'synthetic'"):
        TrainConfig(data="synthetic", image_column="img")
    with pytest.raises(ValueError, match="remat_names"):
        TrainConfig(remat=Remat.NAMED)
    tok = character_tokenizer(max_length=32)
    with pytest.raises(DataError, match=r"caption_column='prompt' is not a column of .*data\.parquet.*\['img', "
                                        r"'caption'\]"):
        load_data(dataclasses.replace(RUN, hf_dataset=str(sources["parquet"]), image_column="img",
                                      caption_column="prompt"), tok)
    with pytest.raises(DataError, match=r"no bytes feature caption_key='text'; its features are \['png', 'prompt'\]"):
        load_data(dataclasses.replace(RUN, tfrecord=sources["tfrecord"], image_key="png"), tok)
    with pytest.raises(DataError, match=r"not 'digits', 'synthetic' or a folder of images or clips with captions; "
                                        r"for a Hugging Face dataset.*use hf_dataset$"):
        load_data(dataclasses.replace(RUN, data=str(sources["parquet"])), tok)
    with pytest.raises(DataError, match=r"not 'digits', 'synthetic' or a folder of images or clips with "
                                        r"captions; for TFRecord files"):
        load_data(dataclasses.replace(RUN, data=sources["tfrecord"][0]), tok)
    with pytest.raises(DataError, match="has 8 samples, fewer than batch_size=16"):
        load_data(dataclasses.replace(RUN, data=str(sources["folder"]), batch_size=16), tok)
    with pytest.raises(DataError, match=r"batch_size=12 must be a multiple of 8: the mesh .* data x fsdp"):
        _run(sources, tmp_path, data="synthetic", batch_size=12)


def test_a_v_prediction_fine_tune_exports_v_prediction(tmp_path):
    """``objective.prediction_type`` other than the folder's (v-prediction of an epsilon folder): the run's noise
    scheduler, samples and export predict it, with the folder's scheduler and with one ``export_scheduler`` names,
    so the export loads back as v-prediction (it was written as the folder's epsilon)."""
    setup = train_setup.build(TrainConfig(architecture=TINY, resolution=TINY.image_size))
    train_setup.export_pipeline(setup.model, setup.tokenizers, setup.noise_scheduler, tmp_path / "pipe")
    assert eqxdiff.load_pipeline(tmp_path / "pipe").scheduler.config.prediction_type == "epsilon"
    for name in (None, "euler"):
        config = TrainConfig(model=str(tmp_path / "pipe"), resolution=TINY.image_size, export_scheduler=name,
                             objective=Objective(prediction_type="v_prediction"))
        setup = train_setup.build(config)
        assert setup.noise_scheduler.config.prediction_type == "v_prediction"
        scheduler = train_setup.sample_scheduler(config, setup)
        train_setup.export_pipeline(setup.model, setup.tokenizers, setup.noise_scheduler, tmp_path / "out",
                                    scheduler=scheduler)
        written = json.loads((tmp_path / "out" / "scheduler" / "scheduler_config.json").read_text())
        assert written["prediction_type"] == "v_prediction", name
        assert eqxdiff.load_pipeline(tmp_path / "out").scheduler.config.prediction_type == "v_prediction"
    from eqxdiff.schedulers import UniPCMultistepScheduler

    wan = UniPCMultistepScheduler.from_config({"prediction_type": "flow_prediction", "use_flow_sigmas": True,
                                               "flow_shift": 3.0})
    assert train_setup.predicting(wan, "epsilon") is wan  # rectified flow predicts the velocity (the loss refuses)


def test_a_scheduler_of_another_noise_process_is_refused(tmp_path):
    """An export (or ``export_scheduler``) sampling another noise process than the model trained on: flow matching's
    scheduler for a DDPM-process model, a DDPM-process one (the default ``dpm++2m``) for a flow-matching model; the
    error names the schedulers that fit (``fitting_schedulers``)."""
    import types

    from eqxdiff.schedulers import FlowMatchEulerDiscreteScheduler, scheduler_from_config

    setup = train_setup.build(TrainConfig(architecture=TINY, resolution=TINY.image_size))
    assert train_setup.fitting_schedulers(setup.noise_scheduler) == [
        "ddim", "pndm", "euler", "euler_a", "lms", "dpm++2m", "dpm++2m_karras", "ddpm", "unipc", "lcm", "tcd"]
    ddpm_message = (r"samples rectified flow, but the model trains on the DDPM noise process \(DDPMScheduler\): its "
                    r"export would not sample it; choose one of \['ddim', 'pndm', ")
    for scheduler in ("flow_euler", scheduler_from_config(setup.noise_scheduler.config.to_dict(), name="flow_euler")):
        with pytest.raises(ValueError, match=ddpm_message):
            train_setup.export_pipeline(setup.model, setup.tokenizers, setup.noise_scheduler, tmp_path / "x",
                                        scheduler=scheduler)
    assert not (tmp_path / "x").exists()
    flow = FlowMatchEulerDiscreteScheduler.from_config({"shift": 3.0})
    flow_setup = types.SimpleNamespace(noise_scheduler=flow)
    assert train_setup.fitting_schedulers(flow) == ["flow_euler"]
    with pytest.raises(ValueError, match=r"^export_scheduler='dpm\+\+2m' \(DPMSolverMultistepScheduler\) samples the "
                                         r"DDPM noise process, but the model trains on rectified flow .*choose one of "
                                         r"\['flow_euler'\] \(or None: the folder's scheduler\)$"):
        train_setup.sample_scheduler(TrainConfig(export_scheduler="dpm++2m"), flow_setup)
    scheduler = train_setup.sample_scheduler(TrainConfig(export_scheduler="flow_euler"), flow_setup)
    assert isinstance(scheduler, FlowMatchEulerDiscreteScheduler) and scheduler.config.shift == 3.0
