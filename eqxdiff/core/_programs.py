"""Traced programs kept across processes: :func:`program`, ``eqx.filter_jit`` that skips tracing and lowering in a
later process.

The persistent compilation cache (:mod:`eqxdiff.core._cache`) keeps what XLA compiled, but a new process still
traces each program in Python and lowers it to StableHLO to find its cache entry: for a small model most of a warm
start's compile time (the digits pipeline's denoising loop: about 0.5 s of tracing and 0.15 s of lowering against
0.2 s of reading its executable). A :func:`program` also keeps the lowered program, exported with
:mod:`jax.export`, in the cache folder's ``exported`` subfolder, and a later process that calls it with arguments of
the same description calls the stored program instead of tracing its function again.

An export is found by a key that describes everything its tracing reads:

- the function (its module and name; outside eqxdiff, JAX and Equinox also its source);
- every argument's pytree structure with its static parts (equinox's static fields, Python numbers, strings,
  classes, functions, dataclass configs), and each array's shape, dtype and weak type;
- the code: a hash of eqxdiff's source files, and the versions of Python, JAX, jaxlib, Equinox and NumPy;
- JAX's settings that change programs (``jax_enable_x64``, the default matmul precision, the PRNG ...), and the
  backend and its device kind.

What the key cannot describe is never stored: a static value of an unknown type, a function whose source cannot be
read, an array on several devices (a sharded program, which an export would fix to its devices), a call inside a
trace, or a program that cannot be exported (a host callback). Those calls run as ``eqx.filter_jit`` does, with the
same results (the reason logged at debug level). An export that cannot be read (a truncated or corrupt file) is a
warning, and the program is traced and stored again. Files are written whole (a temporary file renamed), so several
processes may share the folder. Without the persistent cache (:func:`~eqxdiff.core.enable_compilation_cache`), a
:func:`program` is ``eqx.filter_jit``.
"""

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import re
import sys
import tempfile
import types
import warnings
import weakref
from pathlib import Path

import equinox as eqx
import jax
import jaxlib
import numpy as np
from jax._src.lax import lax as _lax  # weak types: no public API sets them

__all__ = ["EXPORTED_SUBFOLDER", "ProgramCacheWarning", "clear_programs", "program", "program_folder"]

EXPORTED_SUBFOLDER = "exported"  # inside the compilation cache folder
_FORMAT = "eqxdiff-exported-1"
UNSTORED = ".unstored"  # beside a program's would-be file: its outputs cannot be stored (traced as filter_jit)
_TRUSTED = ("eqxdiff", "jax", "jaxlib", "equinox", "numpy", "builtins", "functools", "operator", "math")
# JAX settings that do not change a traced program (logging, caches, dumps, transfers, distributed set-up): left out
# of the key. Any other setting, known or new, is part of it.
_NOT_IN_KEY = re.compile(r"cache|log|dump|traceback|pprint|profil|pgle|transfer|timeout|visible_devices|distributed|"
                         r"preemption|recoverability|thread_guard|source_url|debug_info|tracer_error|"
                         r"captured_constants_(report|warn)|locations|cross_host|proxy_envs")
logger = logging.getLogger(__name__)
_PROGRAMS: "weakref.WeakSet[_Program]" = weakref.WeakSet()  # for clear_programs


class ProgramCacheWarning(UserWarning):
    """A stored program could not be read: it is traced and stored again."""


class _Undescribed(Exception):
    """A value the key cannot describe: the call is not stored."""


def program_folder() -> Path | None:
    """Where :func:`program` keeps exported programs: the ``exported`` subfolder of JAX's persistent compilation
    cache folder, or ``None`` when that cache is off."""
    folder = jax.config.jax_compilation_cache_dir
    if not (jax.config.jax_enable_compilation_cache and folder) or jax.config.jax_disable_jit or not _serializable():
        return None
    return Path(folder) / EXPORTED_SUBFOLDER


@functools.cache
def _serializable() -> bool:
    """Whether jax.export can write programs here (it needs the ``flatbuffers`` package, an eqxdiff dependency)."""
    found = importlib.util.find_spec("flatbuffers") is not None
    if not found:
        logger.warning("eqxdiff.core.program: 'flatbuffers' is not installed, so traced programs are not kept "
                       "(pip install flatbuffers)")
    return found


@functools.cache
def _code_fingerprint() -> str:
    """A hash of eqxdiff's source files and of the versions its programs depend on, taken when this module is
    imported (before the pipelines' modules are): a file edited later, while this process runs the code it read
    before, does not give that code's programs the edited file's key."""
    digest = hashlib.sha256(_FORMAT.encode())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sorted(os.path.relpath(os.path.join(folder, name), root) for folder, _, names in os.walk(root)
                   for name in names if name.endswith(".py"))
    for name in files:
        with open(os.path.join(root, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    versions = [sys.version, jax.__version__, jaxlib.__version__, eqx.__version__, np.__version__]
    digest.update(repr(versions).encode())
    return digest.hexdigest()


def _settings() -> str:
    values = jax.config.values
    return repr(sorted((k, repr(v)) for k, v in values.items() if not _NOT_IN_KEY.search(k)))


def _source_hash(obj) -> str:
    try:
        return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
    except (OSError, TypeError) as e:
        raise _Undescribed(f"the source of {obj!r} cannot be read") from e


def _trusted(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in _TRUSTED


def _name(obj) -> str:
    """A class or function by its module and qualified name, with its source's hash outside the trusted packages."""
    name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    return name if _trusted(obj) else f"{name}#{_source_hash(obj)}"


def _code(code: types.CodeType) -> str:
    """A function's bytecode, constants and names (two lambdas in one scope have the same name)."""
    consts = [_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return hashlib.sha256(code.co_code + repr((consts, code.co_names, code.co_varnames)).encode()).hexdigest()[:16]


def _function(fn: types.FunctionType) -> str:
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    return (f"fn:{_name(fn)}:{_code(fn.__code__)}({describe(fn.__defaults__)},{describe(fn.__kwdefaults__)},"
            f"{describe(cells)})")


def describe(x) -> str:
    """A static value as a string that differs whenever tracing may differ; :class:`_Undescribed` when unknown."""
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return f"{type(x).__name__}:{x!r}"
    if isinstance(x, enum.Enum):
        return f"enum:{_name(type(x))}.{x.name}"
    if isinstance(x, (tuple, list, set, frozenset)):
        items = [describe(v) for v in x]
        return f"{_name(type(x))}[{','.join(sorted(items) if isinstance(x, (set, frozenset)) else items)}]"
    if isinstance(x, dict):
        return f"{_name(type(x))}{{{','.join(sorted(f'{describe(k)}:{describe(v)}' for k, v in x.items()))}}}"
    if isinstance(x, type):
        return f"type:{_name(x)}"
    if isinstance(x, types.ModuleType) and x.__name__.split(".")[0] in _TRUSTED:
        return f"module:{x.__name__}"
    if isinstance(x, np.dtype):
        return f"dtype:{x}"
    if isinstance(x, types.FunctionType):
        return _function(x)
    if isinstance(x, (types.BuiltinFunctionType, np.ufunc)):
        return f"builtin:{getattr(x, '__module__', None)}.{getattr(x, '__qualname__', x.__name__)}"
    if isinstance(x, types.MethodType):
        return f"method:{describe(x.__func__)}@{describe(x.__self__)}"
    if isinstance(x, functools.partial):
        return f"partial:{describe(x.func)}({describe(x.args)},{describe(x.keywords)})"
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        a = np.asarray(x)
        return f"array:{a.dtype}{a.shape}:{hashlib.sha256(a.tobytes()).hexdigest()[:16]}"
    if dataclasses.is_dataclass(x):  # configs, and modules held as static values (every field, repr or not)
        fields = ",".join(f"{f.name}={describe(getattr(x, f.name, None))}" for f in dataclasses.fields(x))
        return f"{_name(type(x))}({fields})"
    wrapped = getattr(x, "__wrapped__", None)  # jax.jit'd functions (jnp's), functools.wraps
    if wrapped is not None and _trusted(type(x)):
        return f"{type(x).__name__}:{describe(wrapped)}"
    stateless = not vars(x) if hasattr(x, "__dict__") else not getattr(type(x), "__slots__", ())
    if stateless and _trusted(type(x)):
        return f"instance:{_name(type(x))}"  # sentinels (equinox's MISSING)
    raise _Undescribed(f"a static value of type {type(x).__qualname__}")


def _describe_tree(treedef) -> str:
    kind, aux = treedef.node_data() or (None, None)
    children = ",".join(_describe_tree(c) for c in treedef.children())
    return "*" if kind is None else f"{_name(kind)}<{describe(aux)}>({children})"


def _placed_type(x, devices: set) -> tuple:
    """An array's ``(shape, dtype, weak type)``; :class:`_Undescribed` inside a trace and for an array placed on
    another device than the default one or on several (a stored program runs on the default device, where an array
    not yet placed goes too)."""
    if isinstance(x, jax.core.Tracer):
        raise _Undescribed("called inside a trace")
    if isinstance(x, jax.Array) and x.committed and x.sharding.device_set != devices:
        raise _Undescribed("an array placed on another device or on several")
    return tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False))  # NumPy's and typed keys' are never weak


def _key(fun, treedef, static, types) -> str:
    arrays = ";".join(f"{dtype}{shape}{'w' if weak else ''}" for shape, dtype, weak in types)
    parts = [_code_fingerprint(), _settings(), jax.default_backend(), jax.devices()[0].device_kind, _name(fun),
             _describe_tree(treedef), describe(static), arrays]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _paths(treedef, path=()):
    """Each non-leaf node's treedef under ``treedef``, with its path of child indices."""
    yield path, treedef
    for i, child in enumerate(treedef.children()):
        yield from _paths(child, (*path, i))


_BUILTIN = {tuple: "tuple", list: "list", dict: "dict", type(None): "none"}


def _skeleton(out_treedef, in_treedef) -> dict:
    """The output structure as data: builtin containers and leaves, and any other node as the path of an equal
    subtree of the inputs (a scheduler state carried through a loop); :class:`_Undescribed` when there is none."""
    kind, aux = out_treedef.node_data() or (None, None)
    if kind is None:
        return {"t": "leaf"}
    if kind in _BUILTIN:
        node = {"t": _BUILTIN[kind], "c": [_skeleton(c, in_treedef) for c in out_treedef.children()]}
        return {**node, "k": list(aux)} if kind is dict else node
    for path, sub in _paths(in_treedef):
        if sub == out_treedef:
            return {"t": "ref", "p": list(path)}
    raise _Undescribed(f"an output node of type {kind.__qualname__} that is not an input's structure")


def _build(skeleton: dict, in_treedef):
    """A placeholder tree of ``skeleton``'s structure (leaves ``0``)."""
    kind = skeleton["t"]
    if kind == "leaf":
        return 0
    if kind == "none":
        return None
    if kind == "ref":
        sub = in_treedef
        for i in skeleton["p"]:
            sub = sub.children()[i]
        return jax.tree.unflatten(sub, [0] * sub.num_leaves)
    children = [_build(c, in_treedef) for c in skeleton["c"]]
    return dict(zip(skeleton["k"], children)) if kind == "dict" else (tuple if kind == "tuple" else list)(children)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _read(data: bytes):
    """``(jitted call, output skeleton)`` of a stored program. Deserialising forgets the outputs' weak types, which
    decide later dtype promotion (and the next call's key): they are given back as stored."""
    header, serialized = data.split(b"\n", 1)
    header = json.loads(header)
    exported = jax.export.deserialize(bytearray(serialized))

    def call(*arrays):
        outs = exported.call(*arrays)
        return tuple(_weak(x) if weak else x for x, weak in zip(outs, header["weak"], strict=True))

    call.__name__ = call.__qualname__ = exported.fun_name  # JAX's logs and cache entries name the function

    # on the default device: arguments placed there or not (numpy, a jitted output) make one program, not two
    return jax.jit(call, in_shardings=jax.sharding.SingleDeviceSharding(_device())), header["outputs"]


def _uncommitted(x):
    """``x`` (an output of a stored program, which JAX commits to its device) as jit gives it for arguments none of
    which were placed: uncommitted, so that JAX may move it to other devices (a pipeline on a mesh mixes such arrays
    with sharded ones). The same buffers; no public API sets this (a JAX without these internals gives the array
    as it is, committed, and says so once)."""
    try:
        if hasattr(x, "_base_array"):  # a typed PRNG key array over its key data
            return type(x)(x._impl, _uncommitted(x._base_array))
        return type(x)(x.aval, x.sharding, x._arrays, committed=False)
    except (AttributeError, TypeError) as e:
        _warn_committed(e)
        return x


@functools.cache
def _warn_committed(error) -> None:
    logger.warning("eqxdiff.core.program: stored programs' outputs stay committed to their device (%s: %s)",
                   type(error).__name__, error)


def _device():
    return jax.config.jax_default_device or jax.devices()[0]


def _weak(x):
    return _lax._convert_element_type(x, x.dtype, weak_type=True)


class _Program:
    """A :func:`program`: ``eqx.filter_jit(fun)``, with exported programs stored and read by key."""

    def __init__(self, fun, jit_kwargs):
        self.fun, self.jitted = fun, eqx.filter_jit(fun, **jit_kwargs)
        self.stored = not jit_kwargs  # donation is not exported: such programs are only jitted
        self.calls: dict = {}  # this process's runs (jitted call, output treedef), by their arguments' description
        functools.update_wrapper(self, fun)
        _PROGRAMS.add(self)

    def clear(self) -> None:
        """Forget this process's runs (as :func:`jax.clear_caches` does compiled programs): the next call reads
        its stored program again, or traces it."""
        self.calls.clear()

    def __get__(self, instance, owner):  # a method: bind as a function would
        return self if instance is None else functools.partial(self, instance)

    def __call__(self, *args, **kwargs):
        folder = program_folder() if self.stored else None
        if folder is None:
            return self.jitted(*args, **kwargs)
        leaves, treedef = jax.tree.flatten((args, kwargs))
        is_array = [eqx.is_array(x) for x in leaves]
        dynamic = [x for x, a in zip(leaves, is_array) if a]
        static = tuple(x for x, a in zip(leaves, is_array) if not a)
        try:
            devices = {_device()}
            types = tuple(_placed_type(x, devices) for x in dynamic)
            local = (treedef, static, types, folder)
            run = self.calls.get(local)
        except (_Undescribed, TypeError):  # a trace, placed elsewhere; unhashable statics: filter_jit says so
            return self.jitted(*args, **kwargs)
        if run is None:
            found = self._load_or_export(folder, treedef, static, is_array, types)
            run = self.calls[local] = found and (found[0], jax.tree.structure(_build(found[1], treedef)))
        if run is False:
            return self.jitted(*args, **kwargs)
        call, out_treedef = run
        outs = call(*dynamic)
        if not any(getattr(x, "committed", False) for x in dynamic):  # as jit's: free to move to other devices
            outs = tuple(map(_uncommitted, outs))
        return jax.tree.unflatten(out_treedef, outs)

    def _load_or_export(self, folder, treedef, static, is_array, types):
        """``(jitted exported call, output skeleton)``, or ``False``: this call runs as ``eqx.filter_jit``."""
        try:
            key = _key(self.fun, treedef, static, types)
        except (_Undescribed, RecursionError) as e:  # RecursionError: a value that holds itself
            logger.debug("%s: not stored (%s)", _name(self.fun), e)
            return False
        path = folder / f"{self.fun.__name__}-{key}"
        if path.with_name(path.name + UNSTORED).exists():  # a program an earlier process found it cannot store
            return False
        if path.exists():
            try:
                return _read(path.read_bytes())
            except Exception as e:  # noqa: BLE001 - any unreadable file: trace and store it again
                warnings.warn(f"the stored program {os.fspath(path)!r} cannot be read ({type(e).__name__}); tracing "
                              f"it again", ProgramCacheWarning, stacklevel=3)
        return self._export(path, treedef, static, is_array, types)

    def _export(self, path, treedef, static, is_array, types):
        out_skeleton = {}

        def flat(*arrays):
            arrays, statics = iter(arrays), iter(static)
            args, kwargs = jax.tree.unflatten(treedef, [next(arrays) if a else next(statics) for a in is_array])
            out = self.fun(*args, **kwargs)
            out_leaves, out_treedef = jax.tree.flatten(out)
            if not all(eqx.is_array(x) for x in out_leaves):
                raise _Undescribed("an output that is not all arrays")
            out_skeleton.update(_skeleton(out_treedef, treedef))
            return tuple(out_leaves)

        flat.__name__ = flat.__qualname__ = self.fun.__name__
        specs = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in types]
        try:
            exported = jax.export.export(jax.jit(flat))(*specs)
        except _Undescribed as e:  # its outputs: the same for every later call of this key, so say so on disk
            logger.debug("%s: not stored (%s)", _name(self.fun), e)
            with contextlib.suppress(OSError):
                _write(path.with_name(path.name + UNSTORED), str(e).encode())
            return False
        except Exception as e:  # noqa: BLE001 - not exportable (a callback ...) or a bad input: filter_jit decides
            logger.debug("%s: not exported (%s: %s)", _name(self.fun), type(e).__name__, e)
            return False
        header = {"outputs": out_skeleton, "weak": [a.weak_type for a in exported.out_avals]}
        data = json.dumps(header).encode() + b"\n" + bytes(exported.serialize())
        try:
            _write(path, data)
        except OSError as e:
            logger.debug("%s: not written (%s)", _name(self.fun), e)
        return _read(data)  # as a later process will: the same program, found in the compilation cache


def clear_programs() -> None:
    """:meth:`_Program.clear` for every :func:`program` (a later process, as far as stored programs go)."""
    for p in list(_PROGRAMS):
        p.clear()


def program(fun=None, **jit_kwargs):
    """``eqx.filter_jit(fun, **jit_kwargs)`` whose lowered programs are also kept in the persistent compilation
    cache's folder (the module docstring), so that a later process does not trace them again. A decorator, with or
    without arguments."""
    if fun is None:
        return functools.partial(program, **jit_kwargs)
    return _Program(fun, jit_kwargs)


_code_fingerprint()
