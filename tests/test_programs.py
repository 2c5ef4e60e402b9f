"""Stored programs (:mod:`eqxdiff.core._programs`): a :func:`~eqxdiff.core.program` traced in one process is read by a
later one (simulated: this process's runs forgotten and JAX's caches cleared) instead of traced; everything tracing
reads is in the key; what the key cannot describe, and calls inside a trace, run as ``eqx.filter_jit``; a damaged
file is a warning and is stored again. The pipelines' programs: tests/test_cache.py."""

import dataclasses
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxdiff.core import ProgramCacheWarning, _programs, compilation_cache, program
from eqxdiff.core._programs import describe

TRACES = []


class Scale(eqx.Module):
    w: jax.Array
    power: int = eqx.field(static=True)

    def __call__(self, x):
        return self.w * x**self.power


class State(eqx.Module):
    x: jax.Array
    n: jax.Array
    label: str = eqx.field(static=True)


def _step(model, state: State, factor, *, offset=None):
    TRACES.append(1)
    x = model(state.x) * factor + (0 if offset is None else offset)
    return {"total": x.sum(), "none": None}, State(x, state.n + 1, state.label)


step = program(_step)
jitted = eqx.filter_jit(_step)


def inputs(**change):
    base = dict(w=jnp.arange(3.0), power=2, x=jnp.ones(3), n=jnp.asarray(0), label="a", factor=0.5)
    base.update(change)
    return (Scale(base["w"], base["power"]), State(base["x"], base["n"], base["label"]), base["factor"])


def stored(folder):
    return sorted((folder / _programs.EXPORTED_SUBFOLDER).glob("_step-*"))


def later_process():
    step.clear()
    jax.clear_caches()


def assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and jax.typeof(a).weak_type == jax.typeof(b).weak_type
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_later_process_reads_the_program_instead_of_tracing(tmp_path):
    args = inputs()
    want = jitted(*args)
    with compilation_cache(tmp_path):
        later_process()
        TRACES.clear()
        assert_same(step(*args), want)
        assert len(TRACES) == 1 and len(stored(tmp_path)) == 1
        later_process()
        got = step(*args)
        assert len(TRACES) == 1, "the stored program was traced again"
        assert_same(got, want)  # the state's class and static label rebuilt; weak types kept (n + 1 is weak)
        assert_same(step(*args), want)  # this process's run: nothing more


CHANGES = {
    "a static field": dict(power=3),
    "a static argument": dict(factor=0.25),
    "a static string": dict(label="b"),
    "a shape": dict(w=jnp.arange(4.0), x=jnp.ones(4)),
    "a dtype": dict(w=jnp.arange(3.0, dtype=jnp.bfloat16), x=jnp.ones(3, jnp.bfloat16)),
    "a weak type": dict(n=jnp.int32(0)),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_what_tracing_reads_is_in_the_key(change, tmp_path):
    with compilation_cache(tmp_path):
        later_process()
        step(*inputs())
        later_process()
        TRACES.clear()
        got = step(*inputs(**change))
        assert len(TRACES) == 1, "a call with other inputs used the stored program"
        assert len(stored(tmp_path)) == 2
    assert_same(got, jitted(*inputs(**change)))


def test_keyword_arguments_are_in_the_key(tmp_path):
    with compilation_cache(tmp_path):
        later_process()
        step(*inputs())
        later_process()
        TRACES.clear()
        got = step(*inputs(), offset=jnp.ones(3))
        assert len(TRACES) == 1
    assert_same(got, jitted(*inputs(), offset=jnp.ones(3)))


def test_functions_and_configs_are_described_by_their_code_and_every_field():
    def make(c):
        return lambda x: x + c

    assert describe(make(1)) != describe(make(2))  # closure values
    assert describe(lambda x: x + 1) != describe(lambda x: x + 2)  # same name, other code

    @dataclasses.dataclass(frozen=True)
    class Config:
        a: int
        hidden: int = dataclasses.field(repr=False)

    assert describe(Config(1, 2)) != describe(Config(1, 3))
    assert describe(jnp.tanh) == describe(jnp.tanh) and describe(np.float32) != describe(np.float16)

    def recursive(n):  # holds itself in its closure: not describable, so not stored
        return 1 if n == 0 else recursive(n - 1)

    with pytest.raises(RecursionError):
        describe(recursive)


class Opaque:
    def __init__(self, value):
        self.value = value


class Holder(eqx.Module):
    w: jax.Array
    what: Opaque = eqx.field(static=True)


@program
def _opaque(holder):
    TRACES.append(1)
    return holder.w * holder.what.value


def test_what_the_key_cannot_describe_is_not_stored(tmp_path):
    with pytest.raises(_programs._Undescribed):
        describe(Opaque(2))
    with compilation_cache(tmp_path):
        _opaque.clear()
        out = _opaque(Holder(jnp.ones(2), Opaque(3.0)))
    np.testing.assert_array_equal(out, [3.0, 3.0])
    assert not (tmp_path / _programs.EXPORTED_SUBFOLDER).exists()


def test_a_call_inside_a_trace_and_without_the_cache_is_filter_jit(tmp_path):
    model, state, factor = inputs()
    with compilation_cache(tmp_path):
        later_process()
        inside = jax.jit(lambda s: step(model, s, factor)[0]["total"])(state)
    assert not (tmp_path / _programs.EXPORTED_SUBFOLDER).exists()
    np.testing.assert_array_equal(inside, jitted(model, state, factor)[0]["total"])
    with compilation_cache(tmp_path, enabled=False):
        assert _programs.program_folder() is None
        later_process()
        assert_same(step(model, state, factor), jitted(model, state, factor))
    assert not (tmp_path / _programs.EXPORTED_SUBFOLDER).exists()


def test_a_damaged_file_is_a_warning_and_is_stored_again(tmp_path):
    args = inputs()
    with compilation_cache(tmp_path):
        later_process()
        step(*args)
        (path,) = stored(tmp_path)
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
        later_process()
        TRACES.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = step(*args)
    assert [w.category for w in caught] == [ProgramCacheWarning], [str(w.message) for w in caught]
    assert "cannot be read" in str(caught[0].message) and len(TRACES) == 1
    _programs._read(path.read_bytes())  # stored again, whole
    assert_same(got, jitted(*args))


def test_outputs_are_placed_as_jit_places_them(tmp_path):
    """A stored program's outputs are committed to their device only when an argument was (JAX commits an exported
    call's outputs; jit leaves them free to move), so a pipeline on a mesh can mix them with sharded arrays."""
    args = inputs()
    other = jax.device_put(jnp.ones(()), jax.devices()[-1])
    with compilation_cache(tmp_path):
        later_process()
        for run in ("exported", "read"):
            out = step(*args)
            assert not any(x.committed for x in jax.tree.leaves(out)), run
            np.testing.assert_array_equal(out[0]["total"] + other, jitted(*args)[0]["total"] + 1)  # moves
            later_process()
        placed = jax.device_put(args, jax.devices()[0])
        assert all(x.committed for x in jax.tree.leaves(step(*placed)))
        key = jax.random.key(3)
        assert not _draw(key).committed and _draw(jax.device_put(key, jax.devices()[0])).committed


@program
def _draw(key):
    return jax.random.split(key)[0]


def test_a_folder_that_cannot_hold_programs_is_not_an_error(tmp_path):
    """``exported`` is a file (or not writable): the call runs and gives the same results; nothing is stored."""
    (tmp_path / _programs.EXPORTED_SUBFOLDER).write_text("not a folder")
    args = inputs()
    with compilation_cache(tmp_path):
        later_process()
        assert_same(step(*args), jitted(*args))
    assert (tmp_path / _programs.EXPORTED_SUBFOLDER).read_text() == "not a folder"


class Pair(eqx.Module):
    a: jax.Array
    b: jax.Array


@program
def _pair(x):
    TRACES.append(1)
    return Pair(x, x + 1)


def test_an_output_that_cannot_be_stored_is_noted_so_later_processes_trace_once(tmp_path, monkeypatch):
    """A new module as output (not an input's structure: the stored program could not rebuild it): traced as
    filter_jit, and a marker file says so, so a later process does not trace it for an export first."""
    with compilation_cache(tmp_path):
        _pair.clear()
        TRACES.clear()
        out = _pair(jnp.ones(2))
        assert isinstance(out, Pair) and len(TRACES) == 2  # the export's trace, then filter_jit's
        (marker,) = (tmp_path / _programs.EXPORTED_SUBFOLDER).iterdir()
        assert marker.name.endswith(_programs.UNSTORED)
        _pair.clear()
        jax.clear_caches()
        TRACES.clear()
        monkeypatch.setattr(_programs._Program, "_export", lambda *a: pytest.fail("exported again"))
        np.testing.assert_array_equal(_pair(jnp.ones(2)).b, [2.0, 2.0])
        assert len(TRACES) == 1
