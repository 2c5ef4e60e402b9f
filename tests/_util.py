"""Shared test helpers: the parity metric, float32 comparisons bounded by a float64 run, and PyTorch <-> JAX layout
conversion."""

import contextlib
import copy
import functools
import os
import sys
import types

import numpy as np


def rel_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|: the per-model parity metric (<= 1e-4 in float32)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"shape mismatch: {a.shape} vs {e.shape}"
    return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))


def assert_close(actual, expected, tol: float = 1e-4, what: str = "output") -> None:
    err = rel_error(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


# -- float32 against float32, bounded by float64 -------------------------------------------------------------------
#
# Two float32 computations of one value (sharded and one device, scanned and unrolled, our layer and PyTorch's) differ
# by their rounding, and that rounding depends on the machine: XLA's CPU kernels sum dot products and convolutions in
# blocks of the vector width (16 floats with AVX-512, 8 with AVX2), LLVM contracts a multiply and an add into one FMA
# only where the instruction set has it, and XLA may hand dots and convolutions to oneDNN/XNNPACK. A constant bound
# (1e-5) passes where it was written and fails elsewhere. So the bound is measured each run: the float32 result taken
# as the reference is compared with a float64 run of the same program, which gives the rounding this program accrues
# in float32 on this machine, and the other float32 result must be no further from the float64 one than that (times
# SLACK). Comparing both float32 results' distances to the float64 run and bounding their difference by the sum
# would be a tautology (the triangle inequality): the bound must come from the reference side alone.

FLOAT32_EPS = float(np.finfo(np.float32).eps)  # 2**-23: a result can not be closer than this, relative to its max
FLOAT64_EPS = float(np.finfo(np.float64).eps)  # 2**-52

# A different summation order rounds about as much as the reference's, not more; but the largest error over an array
# is one draw of that rounding, so it lands up to a few times above the reference's largest. Measured (the ratio of
# the two distances to float64): at most 3.8 over the 125 VAE gradient leaves on meshes (tests/test_parallel.py, two
# seeds, the native ISA and --xla_cpu_max_isa=AVX2 and AVX, i.e. with and without FMA); at most 5.6 over 40 seeds of
# every float32 attention case (the largest: a per-key bias gradient, 74 sums over heads and queries); at most 1.5
# over the layer parity tests. 16 leaves a factor of about three over what was seen; an error of 1e-4 still fails
# wherever float32 rounds by less than 6e-6 (whole small models round by ~1e-6, single layers by ~1e-7).
SLACK = 16.0


def max_error(actual, reference, scale=None) -> float:
    """max |actual - reference| / scale (default max |reference|; an array: per element), computed in float64."""
    a = np.asarray(actual, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    if a.shape != r.shape:
        raise AssertionError(f"shape mismatch: {a.shape} vs {r.shape}")
    if not a.size:
        return 0.0
    if scale is None:
        scale = np.max(np.abs(r))
    return float(np.max(np.abs(a - r) / np.maximum(scale, 1e-300)))


def assert_close_to_float64(actual, expected, reference64, *, what: str = "output", slack: float = SLACK,
                            scale: float | None = None, elementwise: bool = False, actual64=None,
                            program_rounding: float = 0.0) -> None:
    """``actual`` and ``expected`` are float32 results of one computation done two ways; ``reference64`` is the
    ``expected`` side's program run in float64 (:func:`run_float64`, :func:`torch_float64`, or a NumPy float64
    formula), the stand-in for the exact value.

    ``rounding = max|expected - reference64| / s`` is what float32 costs this program on this machine (``s`` is
    ``max|reference64|``; ``scale`` for a value that is zero in exact arithmetic: the scale it is noise on).
    The check: ``max|actual - reference64| / s <= slack * max(rounding, FLOAT32_EPS)``, i.e. ``actual`` is as
    accurate as ``expected`` up to the slack of a different summation order; ``|actual - expected|`` is then within
    ``(1 + slack)`` times the same, and the message prints all three numbers. A bug (a wrong term, a lost scale, a
    bf16 cast) moves ``actual`` away from the float64 value and fails, whatever the difference of the two float32
    results happened to be. ``program_rounding``: the rounding measured over all outputs of the program this is
    one of (:func:`assert_leaves_close_to_float64`), used where it is larger than this output's own.
    ``elementwise``: each element is its own computation (a schedule's entries, an
    elementwise formula), checked as ``rtol`` would be: relative to its own float64 value, against its own rounding.

    ``actual64``, the ``actual`` side's own program in float64 (our layer where ``reference64`` is PyTorch's), adds
    the check that the two programs compute the same function, free of float32 noise: the float64 results may differ
    only by float64 rounding, bounded as float32's is but 2**29 times finer (first-order rounding errors scale with
    the unit roundoff). Leave it out where a program rounds a constant to float32 on purpose."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    r = np.asarray(reference64, dtype=np.float64)
    if not a.shape == e.shape == r.shape:
        raise AssertionError(f"{what}: shapes differ: actual {a.shape}, expected {e.shape}, float64 {r.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(e)) and np.all(np.isfinite(r))):
        raise AssertionError(f"{what}: non-finite values (actual {np.isfinite(a).all()}, expected "
                             f"{np.isfinite(e).all()}, float64 {np.isfinite(r).all()} all finite)")
    largest = float(np.max(np.abs(r))) if r.size else 0.0
    if largest == 0.0 and scale is None:
        np.testing.assert_array_equal(a, e, err_msg=f"{what}: the float64 value is all zeros")
        return
    if elementwise:  # each element its own computation: its own rounding and bound (an exact zero: the largest's)
        s = np.where(r != 0, np.abs(r), largest)
        roundings, errors = np.abs(e - r) / s, np.abs(a - r) / s
        worst = tuple(int(i) for i in np.unravel_index(np.argmax(errors / np.maximum(roundings, FLOAT32_EPS)),
                                                        r.shape))
        rounding, error, difference = float(roundings[worst]), float(errors[worst]), float(abs(a - e)[worst] / s[worst])
        relative = f"relative to the float64 value {r[worst]:.6e} at {worst}, the worst element"
    else:
        s = largest if scale is None else float(scale)
        rounding, error, difference = max_error(e, r, s), max_error(a, r, s), max_error(a, e, s)
        relative = f"all relative to {s:.3e}"
    if program_rounding > rounding:
        relative += f"; the float32 reference's own rounding is {rounding:.3e}, the program's {program_rounding:.3e}"
        rounding = program_rounding
    bound = slack * max(rounding, FLOAT32_EPS)
    error64 = None if actual64 is None else max_error(actual64, r, s)
    if os.environ.get("EQXDIFF_ROUNDING_LOG"):  # to re-measure SLACK on a machine: one line per comparison
        with open(os.environ["EQXDIFF_ROUNDING_LOG"], "a") as log:
            print(f"{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}\t{what}\t{error:.3e}\t{rounding:.3e}\t"
                  f"{error / max(rounding, FLOAT32_EPS):.3f}\t{'' if error64 is None else f'{error64:.3e}'}", file=log)
    assert error <= bound, (
        f"{what}: {error:.3e} from the float64 value, more than {slack:g} x the float32 reference's own "
        f"{rounding:.3e} (bound {bound:.3e}); the two float32 results differ by {difference:.3e} ({relative})")
    if actual64 is not None:
        bound64 = slack * max(max_error(e, r, s), FLOAT32_EPS) * FLOAT64_EPS / FLOAT32_EPS
        assert error64 <= bound64, (
            f"{what}: the two programs differ in float64 by {error64:.3e}, more than float64 rounding ({bound64:.3e}: "
            f"the float32 bound scaled by 2**-29); in float32 they differ by {difference:.3e}")


def assert_leaves_close_to_float64(actual, expected, reference64, *, what: str = "leaf", slack: float = SLACK) -> None:
    """:func:`assert_close_to_float64` leaf by leaf of three pytrees (gradients, optimizer states), each leaf relative
    to its own largest float64 entry; a leaf below float32's resolution of the largest entry of all (zero in exact
    arithmetic, like an attention's key-bias gradient: softmax ignores it, so it holds only rounding noise) is
    measured on that largest entry's scale.

    The trees are one program's outputs, so their float32 rounding is measured over all of them: each leaf is
    allowed ``slack`` times the largest relative rounding of any leaf. (A leaf of a few elements is one small draw
    of that rounding, and rounding errors that happened to cancel in the reference, such as two accumulated
    micro-steps' gradients, make it a lucky one: measured alone it asks for more accuracy than float32 has.)"""
    import jax

    got, want64 = jax.tree.leaves(actual), jax.tree.leaves(reference64)
    paths, want = zip(*jax.tree_util.tree_flatten_with_path(expected)[0]) if jax.tree.leaves(expected) else ((), ())
    assert len(got) == len(want) == len(want64) > 0, (len(got), len(want), len(want64))
    largest = max(float(np.max(np.abs(b))) for b in want64)
    scales = [largest if float(np.max(np.abs(b))) < FLOAT32_EPS * largest else None for b in want64]
    rounding = max(max_error(b, b64, s) for b, b64, s in zip(want, want64, scales))
    for path, a, b, b64, s in zip(paths, got, want, want64, scales):
        assert_close_to_float64(a, b, b64, what=f"{what} {jax.tree_util.keystr(path)} {np.shape(b)}", slack=slack,
                                scale=s, program_rounding=rounding)


class _Float32AsFloat64(types.ModuleType):
    """A module (``jax.numpy``, ``torch``, ``numpy``) whose ``float32`` is its ``float64``; the other names are the
    module's own, except those given in ``overrides``."""

    def __init__(self, module, float64, overrides=None):
        super().__init__(f"{module.__name__} (float32 -> float64)")
        self._module, self._float64, self._overrides = module, float64, overrides or {}

    def __getattr__(self, name):
        if name == "float32":
            return self._float64
        return self._overrides[name] if name in self._overrides else getattr(self._module, name)


@contextlib.contextmanager
def _swap_globals(package: str, swaps: dict):
    """In every loaded module of ``package``, each global that *is* a key of ``swaps`` names its value meanwhile."""
    done = []
    for name, module in list(sys.modules.items()):
        if name != package and not name.startswith(package + "."):
            continue
        for attr, value in list(vars(module).items()):
            if any(value is old for old in swaps):
                new = next(v for old, v in swaps.items() if value is old)
                setattr(module, attr, new)
                done.append((module, attr, value))
    try:
        yield
    finally:
        for module, attr, value in done:
            setattr(module, attr, value)


def _float32_draws():
    """``jax.random``'s float draws made in float32 and then cast to the dtype asked for: under x64 the same key would
    otherwise give other numbers (a float64 normal reads the random bits differently)."""
    import jax
    import jax.numpy as jnp

    normal, uniform, bernoulli = jax.random.normal, jax.random.uniform, jax.random.bernoulli

    def normal32(key, shape=(), dtype=float, *args, **kwargs):
        return normal(key, shape, jnp.float32, *args, **kwargs).astype(dtype)

    def uniform32(key, shape=(), dtype=float, minval=0.0, maxval=1.0, *args, **kwargs):
        return uniform(key, shape, jnp.float32, minval, maxval, *args, **kwargs).astype(dtype)

    def bernoulli32(key, p=0.5, shape=None, *args, **kwargs):
        return bernoulli(key, jnp.asarray(p).astype(jnp.float32), shape, *args, **kwargs)

    return {normal: normal32, uniform: uniform32, bernoulli: bernoulli32}


@contextlib.contextmanager
def float64_jax():
    """JAX computing in float64: ``jax.enable_x64`` (part of ``jit``'s cache key, so a float32 program compiled
    before is not reused) and, while it lasts, eqxdiff's "at least float32" casts (``x.astype(jnp.float32)`` for
    norm statistics, softmax, RoPE, modulation, scheduler tables) raised to float64 by giving eqxdiff's modules a
    ``jnp`` whose ``float32`` is float64; otherwise the float64 run would round back to float32 at every norm.
    Constants eqxdiff rounds to float32 on purpose in NumPy (RoPE angles, timestep frequencies: PyTorch's float32
    values) stay as they are: they are data of the program, the same in both runs. Random normals, uniforms and
    Bernoullis are drawn in float32 and raised, so a float64 run draws the float32 run's numbers from the same keys
    (integers drawn with an explicit ``dtype=jnp.int32`` are the same anyway). Trace inside the context, run
    anywhere."""
    import jax
    import jax.numpy as jnp

    draws = _float32_draws()
    with _swap_globals("eqxdiff", {jnp: _Float32AsFloat64(jnp, jnp.float64)}), jax.enable_x64(True):
        replaced = {name: getattr(jax.random, name) for name in ("normal", "uniform", "bernoulli")}
        for name, fn in replaced.items():
            setattr(jax.random, name, draws[fn])
        try:
            yield
        finally:
            for name, fn in replaced.items():
                setattr(jax.random, name, fn)


@contextlib.contextmanager
def diffusers_float64():
    """diffusers' schedulers computing in float64: in their modules ``torch.float32`` and ``np.float32`` name
    float64 (betas, sigmas, timesteps, ``sample.to(torch.float32)``), so a scheduler built and stepped inside runs
    the same program in float64 on float64 samples. Its random draws stay float32 draws (cast): the same noise as
    the float32 run's from the same generator."""
    import diffusers.utils.torch_utils
    import torch

    def randn_tensor(shape, generator=None, device=None, dtype=None, layout=None):
        out = _randn_tensor(shape, generator=generator, device=device, dtype=torch.float32, layout=layout)
        return out if dtype is None else out.to(dtype)

    def randn(*size, dtype=None, **kwargs):
        out = torch.randn(*size, dtype=torch.float32, **kwargs)
        return out if dtype is None else out.to(dtype)

    _randn_tensor = diffusers.utils.torch_utils.randn_tensor
    swaps = {torch: _Float32AsFloat64(torch, torch.float64, {"randn": randn}),
             np: _Float32AsFloat64(np, np.float64), _randn_tensor: randn_tensor}
    with _swap_globals("diffusers.schedulers", swaps):
        yield


def to_float64(tree):
    """Every floating array leaf of ``tree`` (JAX or NumPy; modules included) as a float64 JAX array on the default
    device. Call it inside :func:`float64_jax` (outside, JAX would truncate to float32)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    def cast(x):
        if isinstance(x, (np.ndarray, np.generic, jax.Array)) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(np.asarray(x, np.float64))
        return x

    return jax.tree.map(cast, tree, is_leaf=lambda x: isinstance(x, np.ndarray) or eqx.is_array(x))


# The float64 runs only need to be far more accurate than float32, not fast: XLA compiles them without its expensive
# LLVM passes (about half the compile time; the float32 programs under test keep their own options).
FLOAT64_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.cache
def _float64_program():
    import equinox as eqx
    import jax

    @functools.partial(jax.jit, static_argnums=(1, 2), compiler_options=FLOAT64_COMPILER_OPTIONS)
    def program(dynamic, static_leaves, static_def):
        fn, args, kwargs = eqx.combine(dynamic, jax.tree.unflatten(static_def, static_leaves))
        return fn(*args, **kwargs)

    return program


def _numeric(x) -> bool:
    """A number or boolean array (not a PRNG key array)."""
    import jax.numpy as jnp

    return hasattr(x, "dtype") and (jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_))


def run_float64(fn, *args, jit: bool = True, **kwargs):
    """``fn(*args, **kwargs)`` with every float array in ``fn`` (a module or bound method: its weights), ``args``
    and ``kwargs`` raised to float64, under :func:`float64_jax`, compiled as one program (once per function,
    structure and shapes, like ``eqx.filter_jit``; ``jit=False``: op by op, for functions that need concrete
    values); the outputs as NumPy float64 arrays (a pytree like ``fn``'s)."""
    import equinox as eqx
    import jax

    with float64_jax():
        dynamic, static = eqx.partition(to_float64((fn, args, kwargs)), eqx.is_array)
        if jit:
            leaves, treedef = jax.tree.flatten(static)
            out = _float64_program()(dynamic, tuple(leaves), treedef)
        else:
            fn, args, kwargs = eqx.combine(dynamic, static)
            out = fn(*args, **kwargs)
        return jax.tree.map(lambda x: np.asarray(x, np.float64) if _numeric(x) else x, out)


@contextlib.contextmanager
def torch_upcasts_float64():
    """diffusers' and transformers' layers computing in float64 on float64 tensors: their "at least float32" upcasts
    (``x.float()``, ``x.to(torch.float32)``, ``dtype=torch.float32``) keep float64 meanwhile (``torch.float32`` names
    float64 in their modules, ``Tensor.float`` leaves a float64 tensor as it is); float32 tensors still become
    float32."""
    import torch

    to_float32 = torch.Tensor.float

    def float_(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else to_float32(self, *args, **kwargs)

    raised = _Float32AsFloat64(torch, torch.float64)
    torch.Tensor.float = float_
    try:
        with _swap_globals("diffusers.models", {torch: raised}), _swap_globals("transformers.models", {torch: raised}):
            yield
    finally:
        torch.Tensor.float = to_float32


def torch_float64(fn, *args, **kwargs):
    """A PyTorch module (a float64 copy of it) or function on ``args``/``kwargs`` with every floating tensor in
    float64, without gradients, under :func:`torch_upcasts_float64`; the outputs as NumPy float64 arrays (tensors
    in tuples, lists and dicts)."""
    import torch

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().double()
        if isinstance(x, (list, tuple)):
            return type(x)(cast(v) for v in x)
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        return x

    def back(x):
        if isinstance(x, torch.Tensor):
            return x.detach().numpy()
        if isinstance(x, (list, tuple)):
            return type(x)(back(v) for v in x)
        if isinstance(x, dict):
            return {k: back(v) for k, v in x.items()}
        return x

    if isinstance(fn, torch.nn.Module):
        fn = copy.deepcopy(fn).double()
    with torch.no_grad(), torch_upcasts_float64():
        return back(fn(*cast(args), **cast(kwargs)))


def to_jax(t):
    """A torch tensor or numpy array as a jax array (layout unchanged)."""
    import jax.numpy as jnp

    return jnp.asarray(t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t))


def nchw_to_nhwc(t):
    """A torch NCHW tensor (or numpy array) as a channels-last jax array."""
    import jax.numpy as jnp

    return jnp.moveaxis(to_jax(t), 1, -1)


def nhwc_to_nchw(a):
    import torch

    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(np.asarray(a), -1, 1)))


def randomize_torch(model, seed: int) -> None:
    """Weights ~ 1/sqrt(fan_in); norm scales ~ 1 +- 0.3 and biases ~ 0 +- 0.3, so a wrong mapping shows and every
    layer differs from the others; a scalar parameter (LTX-Video's ``timestep_scale_multiplier``) ~ its value
    times 1 +- 0.3."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 0:
                p.mul_(1.0 + 0.3 * torch.randn((), generator=g))
            elif p.ndim == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
