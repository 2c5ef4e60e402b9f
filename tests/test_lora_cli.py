"""LoRA on the command line and the pipelines' follow-ups, on the shipped digits model (a tiny Stable Diffusion
folder; its LoRA files are built here, every tensor random and non-zero).

- ``eqxdiff-generate --lora FILE[:SCALE]`` (twice, two files of one name) draws what the Python API draws with the
  same adapters and strengths, pixel for pixel, and records name, scale, sha256 and path in the PNG; ``--fuse-lora``
  draws what ``fuse_lora()`` does; a Hub id is fetched and recorded with its revision.
- ``--lora-info FILE`` prints ``eqxdiff.lora.inspect``'s report (with ``--model``, what adapts that pipeline, from
  its configs alone) and exits 0 without loading.
- ``from_pipe`` / ``with_scheduler`` carry the adapters' bookkeeping (a copy) for the models they share.
- ``save_pipeline`` / ``save_pretrained`` of a model holding unfused adapters write the weights only, with one
  warning that says to fuse first; fused adapters are saved in the weights.

The refusals of bad ``--lora`` flags are rows of tests/test_bad_inputs.py's table.
"""

import dataclasses
import hashlib
import re
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save_file

import eqxdiff
from eqxdiff import nn
from eqxdiff.cli import _lora, generate
from eqxdiff.cli._generate_flags import DIGITS_PROMPT
from eqxdiff.loading import AdaptersNotSavedWarning, SafetensorsFile
from eqxdiff.pipelines import InputError, StableDiffusionPipeline, read_parameters

LoraWarning = eqxdiff.lora.LoraWarning
ARGV = ["--steps", "2", "--seed", "3", "--no-progress", "--no-compilation-cache"]
ATTENTION = r"attn[12]\.to_(q|k|v|out\.0)$"


def digits_lora(path, pipe, *, seed: int = 0, rank: int = 2, pattern: str = ATTENTION, extra: dict | None = None):
    """A PEFT file (``unet.<name>.lora_A.weight`` / ``lora_B.weight``) for the digits UNet's layers matching
    ``pattern``: every tensor random, the change large enough to move a 16-pixel digit."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for site in nn.adapter_sites(pipe.unet):
        if site.layers is None and re.search(pattern, site.name):
            out, fan_in, kernel = site.shape[0], int(np.prod(site.shape[1:])), (1,) * (len(site.shape) - 2)
            tensors[f"unet.{site.name}.lora_A.weight"] = (rng.standard_normal((rank, *site.shape[1:]))
                                                          / np.sqrt(fan_in)).astype(np.float32)
            tensors[f"unet.{site.name}.lora_B.weight"] = (rng.standard_normal((out, rank, *kernel))
                                                          * 0.5).astype(np.float32)
    tensors.update(extra or {})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(path)


def flux_lora(path):
    """kohya's Black Forest Labs names (Flux.1's fused ``qkv``): a file for another family."""
    t = {f"lora_unet_double_blocks_{i}_img_attn_qkv.lora_down.weight": np.ones((2, 8), np.float32) for i in range(3)}
    t.update({k.replace("down", "up"): np.ones((24, 2), np.float32) for k in list(t)})
    save_file(t, str(path))
    return Path(path)


@pytest.fixture(scope="module")
def pipe():
    return eqxdiff.load_pipeline("digits")


@pytest.fixture(scope="module")
def files(pipe, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {"style": digits_lora(root / "style.safetensors", pipe, seed=1),
            "style_2": digits_lora(root / "other" / "style.safetensors", pipe, seed=2, pattern=r"attn2\.to_(k|v)$"),
            "partly": digits_lora(root / "partly.safetensors", pipe, seed=3,
                                  extra={"unet.no.such.layer.lora_A.weight": np.ones((2, 4), np.float32),
                                         "unet.no.such.layer.lora_B.weight": np.ones((4, 2), np.float32)}),
            "root": root}


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path))


def _api(pipe, adapters, *, fuse=False) -> np.ndarray:
    """The Python API's image with ``adapters`` (name -> (file, scale)), unloaded afterwards."""
    try:
        for name, (path, _) in adapters.items():
            pipe.load_lora_weights(path, adapter_name=name)
        pipe.set_adapters(list(adapters), [scale for _, scale in adapters.values()])
        if fuse:
            pipe.fuse_lora()
        return np.asarray(pipe(DIGITS_PROMPT, num_inference_steps=2, seed=3, progress=False))[0]
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


def test_command_draws_what_the_python_api_draws_and_records_the_adapters(pipe, files, tmp_path):
    style, other = files["style"], files["style_2"]
    paths = generate.main([*ARGV, "--lora", f"{style}:0.7", "--lora", f"{other}:-0.5", "--output-dir", str(tmp_path)])
    got = _pixels(paths[0])
    expected = _api(pipe, {"style": (style, 0.7), "style_2": (other, -0.5)})
    np.testing.assert_array_equal(got, expected)
    plain = np.asarray(pipe(DIGITS_PROMPT, num_inference_steps=2, seed=3, progress=False))[0]
    assert np.max(np.abs(got.astype(int) - plain.astype(int))) > 8, "the adapters did not move the image"
    params = read_parameters(paths[0])
    assert params["lora"] == [
        {"name": "style", "scale": 0.7, "path": str(style), "sha256": hashlib.sha256(style.read_bytes()).hexdigest()},
        {"name": "style_2", "scale": -0.5, "path": str(other),
         "sha256": hashlib.sha256(other.read_bytes()).hexdigest()}]
    assert "fuse_lora" not in params


def test_fuse_lora_draws_what_fuse_lora_draws(pipe, files, tmp_path):
    style = files["style"]
    paths = generate.main([*ARGV, "--lora", str(style), "--fuse-lora", "--output-dir", str(tmp_path)])
    np.testing.assert_array_equal(_pixels(paths[0]), _api(pipe, {"style": (style, 1.0)}, fuse=True))
    params = read_parameters(paths[0])
    assert params["fuse_lora"] is True and [a["name"] for a in params["lora"]] == ["style"]
    assert params["lora"][0]["scale"] == 1.0


def test_a_hub_id_is_fetched_and_recorded_with_its_revision(files, tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = tmp_path / "models--owner--styles" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "pixel.safetensors").write_bytes(files["style"].read_bytes())
    asked = []

    def download(repo_id, filename, revision=None, **kwargs):
        asked.append((repo_id, filename, revision))
        return str(snapshot / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(generate, "load_pipeline", _must_not_load)
    checked = generate.validate(["--lora", "owner/styles/pixel.safetensors:0.25"])
    assert asked == [("owner/styles", "pixel.safetensors", None)]
    (spec,) = checked.loras
    assert (spec.name, spec.scale, spec.file) == ("pixel", 0.25, str(snapshot / "pixel.safetensors"))
    assert spec.record() == {"name": "pixel", "scale": 0.25, "hub_id": "owner/styles", "weight_name":
                             "pixel.safetensors", "revision": "0123abcd",
                             "sha256": hashlib.sha256(files["style"].read_bytes()).hexdigest()}


def test_a_hub_file_that_cannot_be_fetched_names_the_flag_and_the_fix(monkeypatch):
    import huggingface_hub

    def offline(repo_id, filename, revision=None, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    monkeypatch.setattr(generate, "load_pipeline", _must_not_load)
    with pytest.raises(eqxdiff.loading.CheckpointError) as info:
        generate.validate(["--lora", "owner/styles"])
    message = str(info.value)
    assert message.startswith("--lora 'owner/styles': could not fetch 'pytorch_lora_weights.safetensors'")
    assert message.endswith(", or name the file in it: owner/name/FILE.safetensors") and "weight_name" not in message


def _must_not_load(*args, **kwargs):
    raise AssertionError("--lora-info and the checks load nothing")


def test_lora_info_prints_the_report_and_what_fits_without_loading(files, capsys, monkeypatch):
    monkeypatch.setattr(generate, "load_pipeline", _must_not_load)
    monkeypatch.setattr(sys, "argv", ["eqxdiff-generate", "--lora-info", str(files["style"])])
    generate.cli()  # no SystemExit: status 0
    report = capsys.readouterr().out
    assert f"LoRA file {files['style']}" in report and "family:         Stable Diffusion 1.x/2.x" in report
    assert "adapter types:  LoRA x" in report and "StableDiffusionPipeline" not in report
    for name, verdict in (("style", "yes, every module"), ("partly", "partly")):
        assert generate.main(["--lora-info", str(files[name]), "--model", "digits"]) == []
        report = capsys.readouterr().out
        assert f"StableDiffusionPipeline: {verdict}" in report, report
    assert "not matched: unet.no.such.layer" in report
    monkeypatch.setattr(sys, "argv", ["eqxdiff-generate", "--lora-info", str(files["root"] / "missing.safetensors")])
    with pytest.raises(SystemExit) as info:
        generate.cli()
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --lora-info '")


def test_two_files_of_one_name_are_named_apart_and_one_file_twice_is_refused(files, monkeypatch):
    monkeypatch.setattr(generate, "load_pipeline", _must_not_load)
    checked = generate.validate(["--lora", str(files["style"]), "--lora", f"{files['style_2']}:0.5"])
    assert [(s.name, s.scale) for s in checked.loras] == [("style", 1.0), ("style_2", 0.5)]
    same = Path(files["root"] / "other" / ".." / "style.safetensors")
    with pytest.raises(InputError, match=r"name the same file; give it once, with the scale you want"):
        generate.validate(["--lora", str(files["style"]), "--lora", f"{same}:0.5"])


def test_no_lora_strict_loads_the_rest_with_a_warning(pipe, files, monkeypatch):
    monkeypatch.setattr(generate, "load_pipeline", _must_not_load)
    argv = ["--lora", str(files["partly"]), "--no-lora-strict"]
    checked = generate.validate(argv)  # strict, this is refused (a row of tests/test_bad_inputs.py)
    try:
        with pytest.warns(LoraWarning, match=r"2 of the \d+ tensors .* adapt nothing .*; loading the rest"):
            records = _lora.apply_loras(pipe, checked.loras, checked.args.lora)
        assert [r["name"] for r in records] == ["partly"] and pipe.get_active_adapters() == ["partly"]
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


def test_a_pipeline_that_reads_no_lora_files_refuses_the_flag():
    quiet = type("QuietPipeline", (StableDiffusionPipeline,), {"LORA_FORMAT": None})
    spec = _lora.LoraSpec("x.safetensors", "x.safetensors", None, False)
    with pytest.raises(InputError, match=r"^--lora: the --model folder's QuietPipeline reads no LoRA files yet"):
        _lora.check_loras(quiet, [spec], _lora.LoraOptions(lora=("x.safetensors",)), {})


# diffusers' pipelines without a LoRA loader (LTXLatentUpsamplePipeline holds no denoiser to adapt)
NO_LORA = {"LTXLatentUpsamplePipeline"}


def test_every_pipeline_of_the_family_table_reads_its_familys_lora_files():
    """Each pipeline class in the family table declares a LoRA format whose namings adapt components it has (LTX-Video
    once declared none, and refused every file), except the ones diffusers gives no LoRA loader either."""
    from eqxdiff.core import FAMILY_TABLE, resolve_class
    from eqxdiff.pipelines._lora_format import load_format

    pipelines = {name: resolve_class(name) for name in FAMILY_TABLE if name.endswith("Pipeline")}
    assert set(NO_LORA) <= set(pipelines)
    for name, cls in pipelines.items():
        fmt = load_format(getattr(cls, "LORA_FORMAT", None))
        if name in NO_LORA:
            assert fmt is None, name
            continue
        assert fmt is not None, f"{name} declares no LORA_FORMAT"
        components = {c.name for c in cls.COMPONENTS}
        assert {n.component for n in fmt.namings} <= components, name


# -- from_pipe / with_scheduler carry the adapters -------------------------------------------------------------------

def _scales(model) -> list[np.ndarray]:
    return [np.asarray(a.scales) for a in nn.adapters_at(model).values()]


def test_from_pipe_and_with_scheduler_carry_the_adapters(pipe, files):
    pipe.load_lora_weights(files["style"], adapter_name="style")
    try:
        pipe.set_adapters("style", 0.5)
        swapped = pipe.with_scheduler("ddim")
        assert swapped.get_list_adapters() == {"unet": ["style"]} and swapped.get_active_adapters() == ["style"]
        swapped.set_adapters("style", 0.8)  # refused before: "no adapter named ['style']"
        assert all(np.allclose(s, 0.8) for s in _scales(swapped.unet))
        assert all(np.allclose(s, 0.5) for s in _scales(pipe.unet)), "the source pipeline's models changed"
        assert pipe.lora_adapters()[0]["weight"] == 0.5
        swapped.disable_lora()
        assert pipe.lora_adapters()[0]["active"] and not swapped.lora_adapters()[0]["active"]
        swapped.enable_lora()
        swapped.fuse_lora()
        assert not nn.adapters_at(swapped.unet) and nn.adapters_at(pipe.unet)
        swapped.unfuse_lora()
        assert swapped.get_list_adapters() == {"unet": ["style"]}
        swapped.unload_lora_weights()  # the very models loaded, the source's untouched
        assert swapped.unet is pipe._lora().original["unet"] and nn.adapters_at(pipe.unet)
        # A component given anew holds none of the adapters: not carried.
        fresh = StableDiffusionPipeline.from_pipe(pipe, unet=pipe._lora().original["unet"])
        assert fresh.get_list_adapters() == {}
        with pytest.raises(ValueError, match="no adapter named"):
            fresh.set_adapters("style")
        assert StableDiffusionPipeline.from_pipe(pipe, unet=pipe.unet).get_list_adapters() == {"unet": ["style"]}
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


# -- saving: the weights only, unless fused --------------------------------------------------------------------------

def _saved_names(folder) -> list[str]:
    return list(SafetensorsFile(Path(folder) / "diffusion_pytorch_model.safetensors").names())


def test_saving_leaves_unfused_adapters_out_with_one_warning(pipe, files, tmp_path):
    plain = jax.tree.leaves(pipe.unet)
    pipe.load_lora_weights(files["style"], adapter_name="style")
    try:
        with pytest.warns(AdaptersNotSavedWarning) as caught:
            eqxdiff.save_pipeline(pipe, tmp_path / "pipe")
        assert len(caught) == 1, [str(w.message) for w in caught]
        assert "the adapters ['style'] are not fused into the weights of unet" in str(caught[0].message)
        assert "pipe.fuse_lora(components=['unet']) before saving" in str(caught[0].message)
        with pytest.warns(AdaptersNotSavedWarning, match=r"UNet2DConditionModel holds unfused LoRA/LyCORIS adapters "
                          r"in \d+ layers: .*fuse them first"):
            eqxdiff.save_pretrained(pipe.unet, tmp_path / "unet")
        for folder in (tmp_path / "pipe" / "unet", tmp_path / "unet"):
            assert not [n for n in _saved_names(folder) if "adapters" in n]
            saved = jax.tree.leaves(eqxdiff.load(folder))
            assert all(np.array_equal(a, b) for a, b in zip(saved, plain, strict=True))
        pipe.fuse_lora()  # fused: in the weights, no warning
        fused = jax.tree.leaves(pipe.unet)
        with warnings.catch_warnings():
            warnings.simplefilter("error", AdaptersNotSavedWarning)
            eqxdiff.save_pipeline(pipe, tmp_path / "fused")
        saved = jax.tree.leaves(eqxdiff.load(tmp_path / "fused" / "unet"))
        assert all(np.array_equal(a, b) for a, b in zip(saved, fused, strict=True))
        assert not all(np.array_equal(a, b) for a, b in zip(saved, plain, strict=True))
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


def test_lora_spec_record_of_a_folder_names_the_folder(pipe, tmp_path):
    folder = tmp_path / "pixel-art"
    digits_lora(folder / "pytorch_lora_weights.safetensors", pipe)
    spec = _lora.locate("--lora", _lora.LoraSpec(str(folder), str(folder), None, False))
    assert [s.name for s in _lora.named([spec])] == ["pixel-art"]
    assert dataclasses.replace(spec, name="x").record()["path"] == str(folder)
