"""The persistent compilation cache (:mod:`eqxdiff.core._cache`): where it lives, what the commands do with their cache
flags, folders that cannot hold it, and, with the shipped digits model, two processes filling one fresh folder at
once, a third process that then compiles nothing, and a corrupt entry compiled again.

The suite's cache folder is its own (``XDG_CACHE_HOME``, set in ``conftest.py``); every folder here is a test's.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

import eqxdiff
from eqxdiff.cli import generate, train
from eqxdiff.core import CacheWarning, _cache, _programs, compilation_cache, default_cache_dir, enable_compilation_cache
from eqxdiff.core._programs import EXPORTED_SUBFOLDER, clear_programs

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")


def settings() -> dict:
    return {name: getattr(jax.config, name) for name in SETTINGS}


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*-cache"))


def test_the_default_folder_is_the_users_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "eqxdiff" / "jax"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # not absolute: ignored, as the XDG specification says
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "eqxdiff" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "eqxdiff" / "jax"
    assert eqxdiff.enable_compilation_cache is enable_compilation_cache  # a lazy name of the package


def test_small_programs_are_kept_and_the_settings_come_back(tmp_path):
    before = settings()
    folder = tmp_path / "new" / "cache"
    with compilation_cache(folder) as used:
        assert used == folder and folder.is_dir()
        # a program of one fused multiply-add: below JAX's default thresholds (1 s of compile time)
        assert jax.jit(lambda x: x * 3.0 + 1.0)(np.arange(4.0)).tolist() == [1.0, 4.0, 7.0, 10.0]
        assert len(entries(folder)) == 1
    assert settings() == before
    jax.jit(lambda x: x * 5.0 - 1.0)(np.arange(4.0))  # the cache is off again: nothing more is written
    assert len(entries(folder)) == 1
    with compilation_cache(folder, enabled=False) as used:
        assert used is None and not jax.config.jax_enable_compilation_cache
    assert settings() == before


def test_the_python_function_turns_the_cache_on_for_the_process(tmp_path):
    before = settings()
    try:
        assert eqxdiff.enable_compilation_cache(tmp_path) == tmp_path
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        jax.jit(lambda x: x - 7.0)(np.arange(3.0))
        assert len(entries(tmp_path)) == 1
    finally:
        _cache._set(before)


def _refuse_probe(folder):
    raise PermissionError(13, "Permission denied")


@pytest.mark.parametrize("case", ["file", "under-a-file", "not-writable"])
def test_a_folder_that_cannot_hold_the_cache_is_a_warning(case, tmp_path, monkeypatch):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    folder, problem = {
        "file": (taken, "is a file"),
        "under-a-file": (taken / "sub" / "cache", f"lies under '{taken}', which is a file"),
        # as root a chmod changes nothing: the write the check makes fails instead
        "not-writable": (tmp_path / "locked", r"cannot be written in \(PermissionError: Permission denied\)"),
    }[case]
    monkeypatch.setattr(_cache, "write_probe", _refuse_probe if case == "not-writable" else _cache.write_probe)
    before = settings()
    with pytest.warns(CacheWarning, match=rf"^the compilation cache folder '{folder}' {problem}; running without the "
                      r"persistent compilation cache, so every program compiles \(pass a folder you can write in\)$"):
        assert enable_compilation_cache(folder) is None
    assert settings() == before
    assert taken.read_text() == "a file"


def _record_settings(seen):
    def record(*args, **kwargs):
        seen.append(settings())
        return []
    return record


def test_the_commands_run_with_their_cache_flags(tmp_path, monkeypatch):
    """Both commands run their work (stubbed here: nothing loads or compiles) with the cache their flags ask for:
    the user's cache folder by default, --compilation-cache-dir's, or none; JAX's settings as before afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    seen = []
    monkeypatch.setattr(generate, "_generate", _record_settings(seen))
    monkeypatch.setattr(train, "run", _record_settings(seen))
    before = settings()
    flags = [[], ["--compilation-cache-dir", str(tmp_path / "mine")], ["--no-compilation-cache"]]
    for extra in flags:
        generate.main(["--steps", "2", *extra])
        train.main(["digits", *extra, "--output-dir", str(tmp_path / "run")])
        assert settings() == before
    dirs = [s["jax_compilation_cache_dir"] for s in seen]
    assert dirs[:4] == [str(tmp_path / "xdg" / "eqxdiff" / "jax")] * 2 + [str(tmp_path / "mine")] * 2
    assert [s["jax_enable_compilation_cache"] for s in seen] == [True] * 4 + [False] * 2
    assert all(s["jax_persistent_cache_min_compile_time_secs"] == 0 for s in seen[:4])
    assert train.parse(["digits", "--no-compilation-cache"]) == train.parse(["digits"])


# -- the digits model: shared, warm, corrupt ------------------------------------------------------------------------

ARGS = ["--steps", "2", "--num-images", "1", "--seed", "5"]  # progress bar on, as the README's command


def _command(cache: Path, out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "generate.py"), *ARGS, "--compilation-cache-dir", str(cache),
            "--output-dir", str(out)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Two eqxdiff-generate processes started together on one fresh cache folder (both compile; each entry is
    written by one of them, the other may read it). The subprocesses compute as this process does (matmul precision,
    8 CPU devices), so their programs have the same cache keys."""
    root = tmp_path_factory.mktemp("shared")
    env = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": jax.config.jax_default_matmul_precision,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    runs = [subprocess.Popen(_command(root / "cache", root / f"out{i}"), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [(run.wait(timeout=600), *run.communicate()) for run in runs]
    return root, results


def _image(folder: Path) -> np.ndarray:
    return np.asarray(Image.open(folder / "image_0.png"))


class _Counts:
    """JAX's compile events in the block: programs compiled by XLA or read from the persistent cache."""

    def __enter__(self):
        self.compiled, self.read, self.written = 0, 0, 0
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def _event(self, name, **kwargs):
        self.read += name == "/jax/compilation_cache/cache_hits"
        self.written += name == "/jax/compilation_cache/cache_misses"

    def _duration(self, name, seconds, **kwargs):
        self.compiled += name == "/jax/core/compile/backend_compile_duration"  # a read from the cache counts too

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_listener(self._event)
        jax.monitoring.unregister_event_duration_listener(self._duration)


def test_two_processes_share_a_fresh_cache_folder(shared):
    root, results = shared
    for code, out, err in results:
        assert code == 0, err[-3000:]
    assert entries(root / "cache"), "nothing was written to the shared folder"
    np.testing.assert_array_equal(_image(root / "out0"), _image(root / "out1"))


def test_a_later_process_compiles_nothing_and_draws_the_same(shared, tmp_path, monkeypatch):
    """This process, its in-memory programs dropped, runs the same command on the folder the two filled: every
    program is read from the cache (the denoising loop with its progress bar too), none compiled or written, and the
    pipeline's programs (eqxdiff.core.program: the text encoder, the noise draws, the denoising loop, the decoder and
    the uint8 conversion) are read as exported programs, none traced."""
    root, results = shared
    assert all(code == 0 for code, _, _ in results)
    assert len(list((root / "cache" / EXPORTED_SUBFOLDER).iterdir())) == 5
    jax.clear_caches()
    clear_programs()
    traced = []
    monkeypatch.setattr(_programs._Program, "_export", lambda self, *a: traced.append(self.__name__))
    with _Counts() as counts:
        generate.main([*ARGS, "--compilation-cache-dir", str(root / "cache"), "--output-dir", str(tmp_path)])
    assert counts.read > 0 and counts.compiled == counts.read and counts.written == 0, vars(counts)
    assert traced == []
    np.testing.assert_array_equal(_image(tmp_path), _image(root / "out0"))


def test_a_corrupt_entry_is_compiled_again(shared, tmp_path):
    """A cache entry cut short (a process killed while writing it, a damaged disk) is a warning from JAX; that
    program is compiled again and the images are right. (Only the decoder's entry is cut, in place: JAX's keys hold
    the folder's path, so a copy of the folder would miss everything. It is put back afterwards.)"""
    root, results = shared
    assert all(code == 0 for code, _, _ in results)
    (entry,) = [p for p in entries(root / "cache") if p.name.startswith("jit_decode_latents-")]
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])
    jax.clear_caches()
    try:
        with _Counts() as counts, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate.main([*ARGS, "--compilation-cache-dir", str(root / "cache"), "--output-dir", str(tmp_path)])
    finally:
        entry.write_bytes(whole)
    messages = [str(w.message) for w in caught if "persistent compilation cache" in str(w.message)]
    assert len(messages) == 1 and "'jit_decode_latents'" in messages[0], messages
    assert counts.compiled == counts.read + 1, vars(counts)  # the decoder compiled, every other program read
    np.testing.assert_array_equal(_image(tmp_path), _image(root / "out0"))


def test_the_progress_bar_moves_each_step_and_runs_the_same_program(shared, monkeypatch):
    """With its progress bar the denoising loop runs the program it runs without (one step per call, the bar moved
    between calls): nothing more compiles, the images are the same, and the program has no host callback, which would
    keep JAX from writing it to the cache (the later process above read it)."""
    from eqxdiff.pipelines import _progress

    root, _ = shared
    ticks = []
    monkeypatch.setattr(_progress, "tick", lambda: ticks.append(1))
    monkeypatch.setattr("eqxdiff.pipelines._denoise.tick", _progress.tick)
    pipe = eqxdiff.load_pipeline("digits")
    kwargs = dict(prompt="a handwritten digit seven", num_inference_steps=2, seed=5)  # the programs of ARGS
    with compilation_cache(root / "cache"):
        quiet = pipe(**kwargs, progress=False)
        with _Counts() as counts:
            shown = pipe(**kwargs, progress=True)
    assert counts.compiled == 0 and len(ticks) == 2, (vars(counts), ticks)
    np.testing.assert_array_equal(np.asarray(shown), np.asarray(quiet))
