"""One parity test base for every model eqxdiff serves: :class:`ModelParity`.

A subclass (one per model and tiny config, named ``Test...`` so that pytest collects it) says how to build the
PyTorch reference and how to run both models; the base then tests, for that subclass:

- ``test_forward_parity``: eqxdiff loaded from the reference's ``save_pretrained`` folder gives the reference's
  outputs, float32, relative error (max|a-b|/max|b|) <= :attr:`ModelParity.tolerance` (1e-4);
- ``test_checkpoint_names_and_shapes``: ``eqxdiff.load`` dispatched through the family table to
  :attr:`~ModelParity.model_class`, and our ``state_dict`` holds exactly the reference's tensors (names as the
  class's ``CHECKPOINT_KEY_MAP`` reads them, less ``CHECKPOINT_IGNORE``), each in the reference's shape;
- ``test_load_rejects_missing_and_unexpected_tensors``: a checkpoint missing one tensor and holding one extra
  raises a ``CheckpointError`` naming both (so "every tensor used, none missing" is what loading checks);
- ``test_save_pretrained_round_trip``: ``eqxdiff.save_pretrained`` -> the reference's ``from_pretrained`` loads
  every tensor (nothing missing, unexpected or resized), equal to the reference's, with the reference's config
  (every public key) and our outputs; ``eqxdiff.load`` reads the folder back to the same config and arrays;
- ``test_bfloat16_run``: loaded in bfloat16, the model keeps bfloat16 weights and activations, its outputs are
  finite and within :attr:`~ModelParity.bf16_tolerance` (a sanity bound: bf16 keeps 8 mantissa bits);
- ``test_full_size_names_on_meta_device[...]``: for each real checkpoint's config in
  :attr:`~ModelParity.full_size` (at least one), the reference built on ``torch.device("meta")`` (nothing
  allocated) has exactly our abstract model's (``eqx.filter_eval_shape``) names and shapes;
- ``test_every_parameter_declares_logical_axes``: every leaf has logical axes of its rank (also on the full-size
  models), the sharding rules' input.

The reference is built, randomised (:func:`tests._util.randomize_torch`: every weight, zero-initialised ones
too), saved, loaded and run once per subclass (:meth:`ModelParity.build`, cached for the session), and our forward
runs through one jitted function (:func:`run_jitted`, XLA backend -O0), so each subclass compiles it once in
float32 and once in bfloat16.

How a new model joins (ControlNet, Flux, Wan, LTX, T5, ...), in ``tests/test_<family>.py``::

    class FluxParity(ModelParity):              # no "Test" prefix: shared by the configs below
        model_class = eqxdiff.models.flux.FluxTransformer2DModel
        reference_class = diffusers.FluxTransformer2DModel   # its __name__ is the family-table key
        full_size = {"flux-dev": {...config.json of the real checkpoint...}}

        def inputs(self, reference):            # numpy arrays (and Python scalars) in OUR layout
            ...
        def reference_outputs(self, reference, inputs):  # run the torch model -> {name: array in our layout}
            ...
        @staticmethod
        def outputs(model, inputs):            # runs under jit -> {name: jax array}, the same names
            ...

    class TestFluxTiny(FluxParity):
        config = dict(patch_size=1, in_channels=4, ...)      # the reference's constructor arguments

    class TestFluxGuidance(FluxParity):
        config = dict(..., guidance_embeds=True)

Give at least two configs that differ in what the code branches on. Optional overrides: ``make_reference(config)``
(a reference not built as ``reference_class(**config)`` / ``reference_class(config_class(**config))``),
``bf16_inputs(inputs)`` (inputs that stay float32 in the bfloat16 run, e.g. timesteps), ``tolerance`` /
``bf16_tolerance``. A model's own checks (error messages, quirks) are plain tests in its file; a module-scoped
fixture returning ``TestFluxTiny.build(tmp_path_factory)`` shares the built models and the compiled forward
(``TestFluxTiny.run(model, inputs)``); ``run_jitted(fn, model, inputs)`` compiles other module-level functions the
same way. ``tests/test_axes.py`` fails for a family-table model without a ``Test...`` subclass here, and asks for
a tiny config (``TINY_CONFIGS``) for its axes walk.
"""

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import eqxdiff
from eqxdiff.core import leaf_specs, resolve_class
from eqxdiff.loading import CheckpointError, SafetensorsFile, keeps_float32, state_dict, weight_files, write_safetensors

from ._util import assert_close, randomize_torch, rel_error, run_float64


@dataclasses.dataclass
class ParityCase:
    """What :meth:`ModelParity.build` made for one subclass; the base's tests and a family's own tests share it."""

    reference: torch.nn.Module  # randomised, eval mode
    folder: Path  # its save_pretrained folder
    model: Any  # eqxdiff.load(folder)
    inputs: Any  # pytree of numpy arrays / Python scalars, our layout
    expected: dict[str, np.ndarray]  # reference outputs in our layout
    actual: dict[str, jax.Array]  # ours, from the same inputs


# Parity runs check the program's numbers, not its speed: compiled at XLA's backend -O0 (the same HLO, about half
# the compile time on a CPU), as tests/test_parallel.py does.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.partial(jax.jit, static_argnums=(0, 2, 3), compiler_options=_FAST_COMPILE)
def _jitted(fn, arrays, static_leaves, static_def):
    return fn(*eqx.combine(arrays, jax.tree.unflatten(static_def, static_leaves)))


def run_jitted(fn, model, inputs):
    """``fn(model, inputs)`` jitted like ``eqx.filter_jit`` (arrays traced, the rest static), one compile per
    function, structure, shapes and dtypes."""
    arrays, static = eqx.partition((model, inputs), eqx.is_array)
    leaves, treedef = jax.tree.flatten(static)
    return _jitted(fn, arrays, tuple(leaves), treedef)


def _to_bfloat16(x):
    if isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(x.dtype, jnp.floating):
        return np.asarray(x).astype(jnp.bfloat16)
    return x


_CASES: dict[type, ParityCase] = {}
_FLOAT64: dict[type, dict[str, np.ndarray]] = {}


class ModelParity:
    """Parity of an eqxdiff model with its diffusers/transformers reference. See the module docstring."""

    model_class: ClassVar[type]  # the eqxdiff class
    reference_class: ClassVar[type]  # the diffusers/transformers class; its __name__ is the checkpoint class name
    config: ClassVar[dict]  # the reference's constructor arguments (transformers: its config class's) at tiny size
    full_size: ClassVar[dict[str, dict]] = {}  # name -> config of a real checkpoint (at least one)
    tolerance: ClassVar[float] = 1e-4
    bf16_tolerance: ClassVar[float] = 5e-2

    # -- what a subclass provides ------------------------------------------------------------------------------
    def inputs(self, reference: torch.nn.Module) -> Any:
        """The inputs, as numpy arrays in eqxdiff's layout (``reference`` is there to read shapes from)."""
        raise NotImplementedError

    def reference_outputs(self, reference: torch.nn.Module, inputs) -> dict[str, Any]:
        """Run the reference on ``inputs`` (converted to its layout) and return its outputs in eqxdiff's layout."""
        raise NotImplementedError

    @staticmethod
    def outputs(model, inputs) -> dict[str, jax.Array]:
        """Run eqxdiff's ``model`` (traced under jit); the same keys as :meth:`reference_outputs`."""
        raise NotImplementedError

    # -- building ----------------------------------------------------------------------------------------------
    @classmethod
    def make_reference(cls, config: dict) -> torch.nn.Module:
        """The reference model at ``config`` (under ``torch.device("meta")`` too)."""
        if issubclass(cls.reference_class, transformers.PreTrainedModel):
            return cls.reference_class(cls.reference_class.config_class(**config))
        return cls.reference_class(**config)

    @classmethod
    def seed(cls) -> int:
        return sum(map(ord, cls.__name__))

    @classmethod
    def run(cls, model, inputs) -> dict[str, jax.Array]:
        """:meth:`outputs` through the jitted function every test of this class shares."""
        return run_jitted(cls.outputs, model, inputs)

    @classmethod
    def actual64(cls, case: ParityCase) -> dict[str, np.ndarray]:
        """Our outputs on ``case.inputs`` computed in float64 (:func:`tests._util.run_float64`, once per class): the
        value a float32 comparison of two ways of running this model (scanned, fused, sliced, on a mesh) measures
        ``case.actual``'s rounding against."""
        if cls not in _FLOAT64:
            _FLOAT64[cls] = run_float64(cls.outputs, case.model, case.inputs)
        return _FLOAT64[cls]

    @classmethod
    def build(cls, tmp_path_factory) -> ParityCase:
        """Build, randomise and save the reference, load it with eqxdiff and run both; once per class."""
        if cls not in _CASES:
            torch.manual_seed(0)
            reference = cls.make_reference(cls.config).eval()
            randomize_torch(reference, seed=cls.seed())
            folder = tmp_path_factory.mktemp(cls.__name__)
            reference.save_pretrained(folder)
            model = eqxdiff.load(folder)
            self = cls()
            inputs = self.inputs(reference)
            with torch.no_grad():
                expected = {k: np.asarray(v) for k, v in self.reference_outputs(reference, inputs).items()}
            _CASES[cls] = ParityCase(reference, folder, model, inputs, expected, cls.run(model, inputs))
        return _CASES[cls]

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls, tmp_path_factory) -> ParityCase:
        return cls.build(tmp_path_factory)

    def pytest_generate_tests(self, metafunc):
        """``full_size_name`` runs over :attr:`full_size`; an empty one gives a failing ``None`` case."""
        if "full_size_name" in metafunc.fixturenames:
            metafunc.parametrize("full_size_name", sorted(type(self).full_size) or [None])

    def bf16_inputs(self, inputs):
        """The inputs of the bfloat16 run: floating arrays cast to bfloat16 (override to keep some in float32)."""
        return jax.tree.map(_to_bfloat16, inputs)

    # -- checkpoint names ---------------------------------------------------------------------------------------
    @classmethod
    def checkpoint_names(cls, names) -> set[str]:
        """Reference tensor names as eqxdiff reads them: the class's key map applied, ignored names dropped."""
        out = set()
        for name in names:
            for pattern, replacement in getattr(cls.model_class, "CHECKPOINT_KEY_MAP", ()):
                name = re.sub(pattern, replacement, name)
            if not any(re.fullmatch(p, name) for p in getattr(cls.model_class, "CHECKPOINT_IGNORE", ())):
                out.add(name)
        return out

    @classmethod
    def reference_shapes(cls, reference: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of the reference's state dict, named as eqxdiff reads it."""
        return {mapped: tuple(t.shape) for name, t in reference.state_dict().items()
                for mapped in cls.checkpoint_names([name])}

    # -- the tests ----------------------------------------------------------------------------------------------
    def test_forward_parity(self, case):
        assert set(case.actual) == set(case.expected), "outputs and reference_outputs must return the same keys"
        for name, expected in case.expected.items():
            assert case.actual[name].shape == expected.shape, name
            assert case.actual[name].dtype == jnp.float32, name
            assert_close(case.actual[name], expected, self.tolerance, what=f"{type(self).__name__} {name}")

    def test_checkpoint_names_and_shapes(self, case):
        name = self.reference_class.__name__
        assert resolve_class(name) is self.model_class, f"the family table does not route {name!r} to this class"
        assert type(case.model) is self.model_class
        ours = {k: v.shape for k, v in state_dict(case.model).items()}
        stored = {}
        for path in weight_files(case.folder):
            f = SafetensorsFile(path)
            stored.update({k: tuple(f.shape(k)) for k in f.names()})
        saved = {mapped: stored[k] for k in stored for mapped in self.checkpoint_names([k])}
        assert ours == saved
        assert ours == self.reference_shapes(case.reference)

    def test_load_rejects_missing_and_unexpected_tensors(self, case, tmp_path):
        (path,) = weight_files(case.folder)
        f = SafetensorsFile(path)
        tensors = {n: np.array(f.get(n)) for n in f.names()}
        dropped = sorted(tensors)[len(tensors) // 2]
        del tensors[dropped]
        tensors["parity_extra.weight"] = np.zeros(3, np.float32)
        write_safetensors(tensors, tmp_path / path.name)
        (tmp_path / "config.json").write_text((case.folder / "config.json").read_text())
        (missing,) = self.checkpoint_names([dropped])
        with pytest.raises(CheckpointError, match=rf"1 tensor\(s\) missing from .*: {re.escape(missing)}\b") as info:
            eqxdiff.load(tmp_path)
        assert re.search(r"1 unexpected tensor\(s\) .*: parity_extra\.weight\b", str(info.value)), info.value

    def test_save_pretrained_round_trip(self, case, tmp_path):
        eqxdiff.save_pretrained(case.model, tmp_path)
        again, info = self.reference_class.from_pretrained(tmp_path, output_loading_info=True)
        again = again.eval()
        assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        assert _public_config(again) == _public_config(case.reference)
        expected = case.reference.state_dict()
        got = again.state_dict()
        assert set(got) == set(expected)
        for name, t in expected.items():  # written and read back, no arithmetic: exactly equal
            torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
        with torch.no_grad():
            theirs = self.reference_outputs(again, case.inputs)
        for name, value in theirs.items():  # the written config.json rebuilds the same reference
            assert_close(case.actual[name], np.asarray(value), self.tolerance, what=f"round trip {name}")
        back = eqxdiff.load(tmp_path)
        assert back.config == case.model.config
        for a, b in zip(jax.tree.leaves(case.model), jax.tree.leaves(back), strict=True):  # stored bytes: exact
            np.testing.assert_array_equal(a, b)

    def test_bfloat16_run(self, case):
        model = eqxdiff.load(case.folder, dtype=jnp.bfloat16)
        keep = self.model_class.keep_in_float32(jnp.bfloat16)  # the reference's _keep_in_fp32_modules
        leaves, specs, _ = leaf_specs(model)
        assert {(s.name, x.dtype) for x, s in zip(leaves, specs)} == {
            (s.name, jnp.dtype(jnp.float32 if keeps_float32(s.name, keep) else jnp.bfloat16)) for s in specs}
        out = self.run(model, self.bf16_inputs(case.inputs))
        for name, expected in case.expected.items():
            got = np.asarray(out[name].astype(jnp.float32))
            assert out[name].dtype == jnp.bfloat16, f"{name} is {out[name].dtype}"
            assert np.all(np.isfinite(got)), name
            err = rel_error(got, expected)
            assert err <= self.bf16_tolerance, f"bfloat16 {name}: relative error {err:.3e} > {self.bf16_tolerance}"

    def test_full_size_names_on_meta_device(self, full_size_name):
        assert full_size_name is not None, f"{type(self).__name__}.full_size names no real checkpoint's config"
        with torch.device("meta"):
            reference = self.make_reference(self.full_size[full_size_name])
        config = self.model_class.config_class.from_dict(_public_config(reference))
        abstract = eqx.filter_eval_shape(lambda: self.model_class(config, key=jax.random.key(0)))
        leaves, specs, _ = leaf_specs(abstract)
        assert {s.name: s.torch_shape(x.shape) for x, s in zip(leaves, specs)} == self.reference_shapes(reference)
        _assert_axes(leaves, specs)

    def test_every_parameter_declares_logical_axes(self, case):
        leaves, specs, _ = leaf_specs(case.model)
        _assert_axes(leaves, specs)


def _public_config(reference: torch.nn.Module) -> dict:
    """A reference's config as its config.json holds it, less private keys (``_name_or_path``, versions)."""
    c = reference.config
    raw = c.to_dict() if hasattr(c, "to_dict") else dict(c)
    return json.loads(json.dumps({k: v for k, v in raw.items() if not k.startswith("_")}))


def _assert_axes(leaves, specs) -> None:
    undeclared = [s.name for s in specs if s.axes is None]
    assert not undeclared, f"parameters without declared logical axes (PARAM_AXES / param_axes()): {undeclared}"
    for x, s in zip(leaves, specs):
        assert len(s.axes) == x.ndim, f"{s.name}: axes {s.axes} for shape {x.shape}"
