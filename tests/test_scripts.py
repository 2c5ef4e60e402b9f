"""The entry scripts, run as a user runs them."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from eqxdiff.pipelines import read_parameters

from ._tiny_sd import build_pipeline

ROOT = Path(__file__).resolve().parent.parent


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_saves_images_with_parameters_and_prints_timings(tmp_path, capsys):
    build_pipeline(tmp_path / "model", scheduler="ddim")
    generate = _load_script("generate")
    args = generate.Args(prompt="a red cat", model=str(tmp_path / "model"), steps=2, height=32, width=32,
                         num_images=2, seed=7, scheduler="euler", output_dir=tmp_path / "out", progress=False,
                         compilation_cache_dir=tmp_path / "cache")
    paths = generate.main(args)
    assert [p.name for p in paths] == ["image_0.png", "image_1.png"]
    params = read_parameters(paths[1])
    assert params["prompt"] == "a red cat" and params["seed"] == 7 and params["steps"] == 2
    assert params["scheduler"] == "EulerDiscreteScheduler" and params["index"] == 1
    assert np.asarray(Image.open(paths[0])).shape == (32, 32, 3)
    err = capsys.readouterr().err
    assert "load:" in err and "compile:" in err and "generation" in err


def test_generate_cli_rejects_bad_flags(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--weights-dtype", "int8"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "weights-dtype" in (out.stderr + out.stdout)


def test_generate_missing_model_says_so(tmp_path):
    generate = _load_script("generate")
    import eqxdiff

    with pytest.raises(eqxdiff.CheckpointError, match="does not exist"):
        generate.main(generate.Args(model=str(tmp_path / "missing"), output_dir=tmp_path / "out"))
