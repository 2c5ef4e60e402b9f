"""Checkpoint loading and saving: files, formats, dtypes, sharded indexes and every error a user can hit."""

import dataclasses
import json
import re
import sys
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import eqxdiff
from eqxdiff import nn
from eqxdiff.core import ConfigError, ModelConfig
from eqxdiff.loading import CheckpointError, SafetensorsFile, write_safetensors
from eqxdiff.models._base import PretrainedModel


@dataclasses.dataclass(frozen=True)
class TinyConfig(ModelConfig):
    SUPPORTED_VALUES = {"act_fn": ("silu",)}
    width: int = 4
    act_fn: str = "silu"


class TinyModel(PretrainedModel):
    config_class = TinyConfig
    CHECKPOINT_IGNORE = (r"buffers\..*",)
    config: TinyConfig = eqx.field(static=True)
    proj: nn.Linear
    conv: nn.Conv2d

    def __init__(self, config, *, dtype=jnp.float32, key):
        k1, k2 = jax.random.split(key)
        self.config = config
        self.proj = nn.Linear(3, config.width, dtype=dtype, key=k1)
        self.conv = nn.Conv2d(config.width, 2, 3, padding=1, dtype=dtype, key=k2)


@pytest.fixture(autouse=True)
def _register_tiny(monkeypatch):
    module = types.ModuleType("eqxdiff_test_tiny")
    module.TinyModel = TinyModel
    monkeypatch.setitem(sys.modules, "eqxdiff_test_tiny", module)
    monkeypatch.setitem(eqxdiff.core.FAMILY_TABLE, "TinyModel", "eqxdiff_test_tiny:TinyModel")


def _torch_weights(width=4):
    torch.manual_seed(0)
    return {"proj.weight": torch.randn(width, 3), "proj.bias": torch.randn(width),
            "conv.weight": torch.randn(2, width, 3, 3), "conv.bias": torch.randn(2)}


def _write_folder(path, weights=None, config=None, name="diffusion_pytorch_model.safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {"_class_name": "TinyModel", "width": 4}))
    save_file(weights if weights is not None else _torch_weights(), str(path / name))
    return path


def test_load_converts_layouts_and_fills_every_leaf(tmp_path):
    folder = _write_folder(tmp_path / "m")
    model = eqxdiff.load(folder)
    w = _torch_weights()
    np.testing.assert_array_equal(model.proj.weight, w["proj.weight"].numpy())
    np.testing.assert_array_equal(model.conv.weight, w["conv.weight"].permute(2, 3, 1, 0).numpy())
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(model))


def test_load_in_bfloat16_and_save_round_trip(tmp_path):
    folder = _write_folder(tmp_path / "m", {k: v.to(torch.bfloat16) for k, v in _torch_weights().items()})
    model = eqxdiff.load(folder, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree_util.tree_leaves(model)} == {jnp.dtype(jnp.bfloat16)}
    out = eqxdiff.save_pretrained(model, tmp_path / "saved")
    assert json.loads((out / "config.json").read_text())["_class_name"] == "TinyModel"
    again = load_file(str(out / "diffusion_pytorch_model.safetensors"))
    for k, v in _torch_weights().items():
        torch.testing.assert_close(again[k], v.to(torch.bfloat16), rtol=0, atol=0)


def test_sharded_index_and_variant(tmp_path):
    w = _torch_weights()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "TinyModel", "width": 4}))
    save_file({k: w[k] for k in ("proj.weight", "proj.bias")}, str(folder / "part-1.safetensors"))
    save_file({k: w[k] for k in ("conv.weight", "conv.bias")}, str(folder / "part-2.safetensors"))
    index = {"weight_map": {k: "part-1.safetensors" if k.startswith("proj") else "part-2.safetensors" for k in w}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    np.testing.assert_array_equal(eqxdiff.load(folder).conv.bias, w["conv.bias"].numpy())
    variant = _write_folder(tmp_path / "v", name="diffusion_pytorch_model.fp16.safetensors")
    eqxdiff.load(variant, variant="fp16")
    with pytest.raises(CheckpointError, match="is the variant right"):
        eqxdiff.load(variant)


def test_sharded_loading_reads_slices_onto_a_mesh(tmp_path):
    folder = _write_folder(tmp_path / "m", _torch_weights(width=8), {"_class_name": "TinyModel", "width": 8})
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    model = eqxdiff.load(folder, sharding=lambda leaf, shape: spec if leaf.name == "proj.weight" else None)
    assert model.proj.weight.sharding == spec
    assert len(model.proj.weight.addressable_shards) == 8
    np.testing.assert_array_equal(model.proj.weight, _torch_weights(8)["proj.weight"].numpy())


def test_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="does not exist"):
        eqxdiff.load(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json not found"):
        eqxdiff.load(empty)
    with pytest.raises(CheckpointError, match="unknown model class 'Mystery'"):
        eqxdiff.load(_write_folder(tmp_path / "u", config={"_class_name": "Mystery"}))
    with pytest.raises(CheckpointError, match="names no model class"):
        eqxdiff.load(_write_folder(tmp_path / "n", config={"width": 4}))
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "config.json").write_text(json.dumps({"_class_name": "TinyModel"}))
    torch.save(_torch_weights(), bin_only / "diffusion_pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only PyTorch pickle weights.*safe_serialization=True"):
        eqxdiff.load(bin_only)


@pytest.mark.parametrize("name", ["model.ckpt", "diffusion_pytorch_model.pt", "weights.pth"])
def test_a_folder_of_pickles_gets_the_pickle_conversion_hint(tmp_path, name):
    """Issue 18: a component folder holding only a .ckpt / .pt / .pth said 'no weights file'; it gets the refusal and
    conversion a pickle passed directly gets (and the pickle is never opened)."""
    folder = tmp_path / "unet"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "TinyModel"}))
    torch.save(_torch_weights(), folder / name)
    pattern = (rf"holds only PyTorch pickle weights \({re.escape(name)}\); eqxdiff reads only \.safetensors files "
               r"\(a pickle can run code when loaded\)\..*safe_serialization=True.*safetensors\.torch\.save_file")
    with pytest.raises(CheckpointError, match=pattern):
        eqxdiff.load(folder)
    with pytest.raises(CheckpointError, match=pattern):
        eqxdiff.load(tmp_path, subfolder="unet")
    w = _torch_weights()
    w["extra.weight"] = torch.zeros(2)
    del w["proj.bias"]
    w["conv.bias"] = torch.zeros(5)
    with pytest.raises(CheckpointError, match=r"missing.*proj\.bias.*unexpected.*extra\.weight.*\(5,\).*expects \(2,\)"):
        eqxdiff.load(_write_folder(tmp_path / "bad", w))
    ok = _torch_weights()
    ok["buffers.position_ids"] = torch.arange(3)
    eqxdiff.load(_write_folder(tmp_path / "ignored", ok))  # declared non-weight tensors may be present
    for dtype in (jnp.int8, "float64", "nonsense"):
        with pytest.raises(CheckpointError, match="dtype"):
            eqxdiff.load(_write_folder(tmp_path / "d"), dtype=dtype)
    with pytest.raises(ConfigError, match="act_fn='gelu'.*supports act_fn in \\['silu'\\]"):
        eqxdiff.load(_write_folder(tmp_path / "c", config={"_class_name": "TinyModel", "act_fn": "gelu"}))
    with pytest.raises(CheckpointError, match="is a file"):
        eqxdiff.load(_write_folder(tmp_path / "f") / "config.json")
    wrong = _write_folder(tmp_path / "w", config={"_class_name": "TinyModel", "width": "4"})
    with pytest.raises(ConfigError, match=rf"config.json in {re.escape(repr(str(wrong)))}: TinyConfig: config value "
                                          r"width='4' has the wrong type; width must be int"):
        eqxdiff.load(wrong)
    with pytest.raises(ConfigError, match=r"with config_overrides \{'width': 2.5\}: .*width=2.5 has the wrong type"):
        eqxdiff.load(_write_folder(tmp_path / "o"), config_overrides={"width": 2.5})


@dataclasses.dataclass(frozen=True)
class _ListConfig(ModelConfig):
    widths: tuple[int, ...] = (4,)
    size: int | tuple[int, int] | None = None


def test_config_types_are_checked_entry_by_entry():
    """Every entry of a list is checked (beartype alone checks one entry at random: a config.json list with one
    wrong entry passed or failed by chance)."""
    for _ in range(10):
        with pytest.raises(ConfigError, match=r"widths=\(4, 4, 4, 4, 4, 4, 4, 4, '8'\) has the wrong type; widths must "
                                              r"be tuple\[int, ...\]"):
            _ListConfig.from_dict({"widths": [4] * 8 + ["8"]})
        with pytest.raises(ConfigError, match=r"size=\(8, '8'\) has the wrong type"):
            _ListConfig.from_dict({"size": [8, "8"]})
    with pytest.raises(ConfigError, match=r"size=\(8, 8, 8\) has the wrong type"):
        _ListConfig.from_dict({"size": [8, 8, 8]})
    with pytest.raises(ConfigError, match=r"widths=\(4, 8.0\) has the wrong type"):
        _ListConfig.from_dict({"widths": [4, 8.0]})
    assert _ListConfig.from_dict({"widths": [4, 8], "size": [8, 16]}) == _ListConfig((4, 8), (8, 16))
    assert _ListConfig.from_dict({"widths": [], "size": 8}).size == 8


def test_hub_id_offline_gives_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="could not fetch 'someone/some-model'.*hf download"):
        eqxdiff.load("someone/some-model")


def test_safetensors_reader_and_writer_agree_with_the_library(tmp_path):
    import ml_dtypes

    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((4,), ml_dtypes.bfloat16),
               "c": np.arange(3, dtype=np.int64)}
    write_safetensors(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    theirs = load_file(str(tmp_path / "x.safetensors"))
    assert theirs["b"].dtype == torch.bfloat16 and theirs["c"].tolist() == [0, 1, 2]
    ours = SafetensorsFile(tmp_path / "x.safetensors")
    assert ours.metadata == {"format": "pt"}
    np.testing.assert_array_equal(ours.get("a"), tensors["a"])
    assert ours.get("b").dtype == ml_dtypes.bfloat16


# -- float8 files, lone .safetensors files, corrupt files and broken JSON -------------------------------------------


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_files_are_read_and_cast(tmp_path, fp8):
    stored = {k: (v * 3).to(fp8) for k, v in _torch_weights().items()}
    folder = _write_folder(tmp_path / "m", stored)
    ours = SafetensorsFile(folder / "diffusion_pytorch_model.safetensors")
    assert ours.get("proj.weight").dtype.itemsize == 1
    np.testing.assert_array_equal(np.asarray(ours.get("proj.weight"), np.float32),
                                  stored["proj.weight"].to(torch.float32).numpy())
    for dtype in (jnp.float32, jnp.bfloat16):
        model = eqxdiff.load(folder, dtype=dtype)
        assert model.proj.weight.dtype == dtype
        np.testing.assert_array_equal(np.asarray(model.proj.weight, np.float32),
                                      stored["proj.weight"].to(torch.float32).numpy())
        np.testing.assert_array_equal(np.asarray(model.conv.weight, np.float32),
                                      stored["conv.weight"].to(torch.float32).permute(2, 3, 1, 0).numpy())


def test_lone_safetensors_file_with_model_class_and_config(tmp_path):
    folder = _write_folder(tmp_path / "m")
    lone = folder / "diffusion_pytorch_model.safetensors"
    want = eqxdiff.load(folder)
    for kwargs in ({"model_class": "TinyModel", "config": {"width": 4}},
                   {"model_class": TinyModel, "config": TinyConfig(width=4)},
                   {"config": {"_class_name": "TinyModel", "width": 4}},  # the config names the class
                   {"config": folder},  # a folder holding config.json
                   {"config": folder / "config.json"}):
        got = eqxdiff.load(lone, **kwargs)
        assert jax.tree_util.tree_all(jax.tree.map(lambda a, b: bool((a == b).all()), got, want)), kwargs
    # renamed keys, read through rules, and the config overridden
    w = _torch_weights(width=6)
    save_file({f"model.{k}": v for k, v in w.items()} | {"model.step": torch.zeros(())},
              str(tmp_path / "x.safetensors"))
    rules = [eqxdiff.loading.Drop("model.step"), eqxdiff.loading.Rename("model.{name}", "{name}")]
    got = eqxdiff.load(tmp_path / "x.safetensors", model_class="TinyModel", config=TinyConfig(),
                       config_overrides={"width": 6}, conversion=rules)
    np.testing.assert_array_equal(got.proj.weight, w["proj.weight"].numpy())


def test_lone_file_errors_say_what_to_pass(tmp_path):
    from eqxdiff.models.clip import CLIPTextConfig

    lone = _write_folder(tmp_path / "m") / "diffusion_pytorch_model.safetensors"
    with pytest.raises(CheckpointError, match=r"is a file; pass the model's folder.*model_class=.*config="):
        eqxdiff.load(lone)
    # the class alone: the message says config= is what is missing, with that class in its example
    with pytest.raises(CheckpointError, match=r"is a file and model_class='TinyModel' does not give its config "
                                              r"\(widths, layers\): pass config= too, eqxdiff\.load\(file, "
                                              r"model_class='TinyModel', config=config_or_folder\)"):
        eqxdiff.load(lone, model_class="TinyModel")
    with pytest.raises(CheckpointError, match="is a file"):
        eqxdiff.load(_write_folder(tmp_path / "f") / "config.json")
    with pytest.raises(CheckpointError, match="not a .safetensors file"):
        eqxdiff.load(tmp_path / "m" / "config.json", model_class="TinyModel", config={})
    with pytest.raises(CheckpointError, match="does not say which model.*model_class="):
        eqxdiff.load(lone, config=TinyConfig())
    with pytest.raises(CheckpointError, match="the config passed to load names no model class.*model_class="):
        eqxdiff.load(lone, config={"width": 4})
    with pytest.raises(CheckpointError, match="unknown model class 'Nope'"):
        eqxdiff.load(lone, model_class="Nope", config={})
    with pytest.raises(CheckpointError, match="model_class=3"):
        eqxdiff.load(lone, model_class=3, config={})
    with pytest.raises(CheckpointError, match="TinyModel takes a TinyConfig, not a CLIPTextConfig"):
        eqxdiff.load(lone, model_class="TinyModel", config=CLIPTextConfig())
    with pytest.raises(CheckpointError, match="config=1.5: pass a config object"):
        eqxdiff.load(lone, model_class="TinyModel", config=1.5)
    with pytest.raises(CheckpointError, match=r"missing.*proj\.weight.*config and the conversion rules fit"):
        eqxdiff.load(lone, model_class="TinyModel", config={},
                     conversion=[eqxdiff.loading.Rename("proj.weight", "proj.w")])


@pytest.mark.parametrize("suffix", [".ckpt", ".PT", ".pth", ".bin"])
def test_a_pickle_file_says_what_it_is_and_how_to_convert_it(tmp_path, suffix):
    """eqxdiff.load of a PyTorch pickle says so and how to convert it: the message load_pipeline and
    eqxdiff-generate give (one message), whatever else the call passes; the file is never unpickled."""
    pickle = tmp_path / f"model{suffix}"
    torch.save(_torch_weights(), pickle)
    expected = (rf"{re.escape(repr(str(pickle)))} is a PyTorch pickle; eqxdiff reads only \.safetensors files .*"
                r"from_single_file\('model" + re.escape(suffix) + r"'\).*safetensors\.torch\.save_file")
    messages = []
    for call in (lambda: eqxdiff.load(pickle), lambda: eqxdiff.load(pickle, model_class="TinyModel", config={}),
                 lambda: eqxdiff.load(pickle, "unet"), lambda: eqxdiff.load_pipeline(pickle)):
        with pytest.raises(CheckpointError, match=expected) as e:
            call()
        messages.append(str(e.value))
    assert len(set(messages)) == 1


def _cut(path, keep_bytes):
    data = path.read_bytes()
    path.write_bytes(data[:keep_bytes])


def test_truncated_or_corrupt_safetensors_are_caught_on_opening(tmp_path):
    import struct

    folder = _write_folder(tmp_path / "m")
    path = folder / "diffusion_pytorch_model.safetensors"
    good = path.read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + n])

    def corrupt(data):
        path.write_bytes(data)
        return pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.safetensors.*truncated or corrupt.*"
                                                    r"Download it again")

    with corrupt(good[:-7]):  # a download cut short: the last tensor runs past the end
        eqxdiff.load(folder)
    with corrupt(good[:n // 2]):  # cut inside the header
        SafetensorsFile(path)
    with corrupt(good[:5]):
        SafetensorsFile(path)
    with corrupt(struct.pack("<Q", n) + b"x" + good[9:]):  # not JSON
        SafetensorsFile(path)
    with corrupt(struct.pack("<Q", n) + b"[" + b" " * (n - 2) + b"]" + good[8 + n:]):
        SafetensorsFile(path)
    bad = dict(header, **{"proj.bias": dict(header["proj.bias"], shape=[5])})  # offsets disagree with the shape
    blob = json.dumps(bad).encode()
    with corrupt(struct.pack("<Q", len(blob)) + blob + good[8 + n:]):
        SafetensorsFile(path)
    path.write_bytes(good)
    eqxdiff.load(folder)


def test_broken_json_names_the_file_and_line(tmp_path):
    from eqxdiff.loading import read_config

    folder = _write_folder(tmp_path / "m")
    (folder / "config.json").write_text('{\n  "_class_name": "TinyModel",\n  "width": 4,\n}\n')
    with pytest.raises(CheckpointError, match=r"config\.json' is not valid JSON: .* line 4, column 1"):
        eqxdiff.load(folder)
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline",\n "unet": ["diffusers" "x"]}')
    with pytest.raises(CheckpointError, match=r"model_index\.json' is not valid JSON: .* line 2"):
        eqxdiff.load_pipeline(folder)
    (folder / "scheduler_config.json").write_text('{"beta_start": 0.1,\n\n "beta_end": }')
    with pytest.raises(CheckpointError, match=r"scheduler_config\.json' is not valid JSON: .* line 3"):
        read_config(folder, "scheduler_config.json")
    (folder / "scheduler_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="holds a JSON list, not an object"):
        read_config(folder, "scheduler_config.json")
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text('{"weight_map": {')
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    (folder / "config.json").write_text('{"_class_name": "TinyModel"}')
    with pytest.raises(CheckpointError, match=r"index\.json' is not valid JSON: .* line 1"):
        eqxdiff.load(folder)


def test_fused_tensor_built_at_load_time_onto_a_mesh(tmp_path):
    w = _torch_weights(width=8)
    top, bottom = w.pop("proj.weight").split(4)
    conv = w.pop("conv.weight")  # a layout change (HWIO) on top of a lazy concatenation
    save_file(w | {"proj.top": top, "proj.bottom": bottom, "conv.0": conv[:1], "conv.1": conv[1:]},
              str(tmp_path / "halves.safetensors"))
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))  # a row per device: one half each
    rules = [eqxdiff.loading.Concat(("proj.top", "proj.bottom"), "proj.weight"),
             eqxdiff.loading.Concat(("conv.0", "conv.1"), "conv.weight")]
    for sharding in (None, lambda leaf, shape: spec if leaf.name == "proj.weight" else None):
        model = eqxdiff.load(tmp_path / "halves.safetensors", model_class="TinyModel", config={"width": 8},
                             conversion=rules, sharding=sharding)
        np.testing.assert_array_equal(model.proj.weight, torch.cat([top, bottom]).numpy())
        np.testing.assert_array_equal(model.conv.weight, conv.permute(2, 3, 1, 0).numpy())
    assert model.proj.weight.sharding == spec
