"""The persistent compilation cache: JAX keeps each compiled program in a folder, so a later process that runs the same
program loads it instead of compiling it again (a warm start).

``eqxdiff-generate`` and ``eqxdiff-train`` turn it on by default in the user's cache folder (:func:`default_cache_dir`);
in Python, :func:`enable_compilation_cache` does. eqxdiff keeps every program, however small or quick to compile:
JAX's defaults skip programs compiled in under a second, which are most of a small model's (and the many small
programs around a large one's loop). A folder that cannot hold the cache (a file, a path under a file, a folder this
process may not write in) is a warning, and compiling goes on without the cache. A cache entry that cannot be read
(a truncated or corrupt file) is JAX's warning, and that program is compiled again; several processes may share one
folder (an entry is written by whichever compiles it first; the others read it or compile it themselves).
"""

import contextlib
import os
import tempfile
import warnings
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

CACHE_SUBFOLDER = Path("eqxdiff") / "jax"  # under $XDG_CACHE_HOME, else ~/.cache
# JAX's settings that decide whether and what it caches, and the values eqxdiff sets: every program is kept
# (min_entry_size -1: no size limit, and JAX does not raise it for the file system; min_compile_time 0: however
# quick its compile).
_EVERY_PROGRAM = {"jax_enable_compilation_cache": True, "jax_persistent_cache_min_compile_time_secs": 0.0,
                  "jax_persistent_cache_min_entry_size_bytes": -1}
_SETTINGS = ("jax_compilation_cache_dir", *_EVERY_PROGRAM)
FIX = "pass a folder you can write in"


class CacheWarning(UserWarning):
    """The compilation cache folder cannot be used: compiling goes on without the persistent cache."""


def default_cache_dir() -> Path:
    """The folder eqxdiff keeps compiled programs in by default: ``$XDG_CACHE_HOME/eqxdiff/jax`` (an absolute
    ``XDG_CACHE_HOME``, as the XDG base directory specification asks), else ``~/.cache/eqxdiff/jax``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / CACHE_SUBFOLDER


def write_probe(folder: Path) -> None:
    """Create and remove a file in ``folder`` (``OSError`` when that fails): what writing in it needs (``os.access``
    answers yes to root on a read-only mount, and says nothing of a full disk)."""
    handle, name = tempfile.mkstemp(prefix=".eqxdiff-probe-", dir=folder)
    os.close(handle)
    os.unlink(name)


def not_a_folder(path) -> tuple[Path, Path, str | None]:
    """``(folder, existing, problem)``: ``path`` made absolute, its nearest existing ancestor (itself when it
    exists), and why it cannot be a folder (``"is a file"``, ``"lies under '/x', which is a file"``) or ``None``."""
    folder = Path(os.path.abspath(Path(path).expanduser()))
    existing = folder
    while not (existing.exists() or existing.is_symlink()):
        existing = existing.parent
    if existing.is_dir():
        return folder, existing, None
    kind = "a file" if existing.is_file() else "not a folder"
    where = f"is {kind}" if existing == folder else f"lies under {os.fspath(existing)!r}, which is {kind}"
    return folder, existing, where


def cache_folder_problem(path) -> str | None:
    """Why ``path`` cannot hold the compilation cache, in a few words (``"is a file"``, ``"lies under '/x', which is
    a file"``, ``"cannot be written in (PermissionError: ...)"``), or ``None`` when it can. Creates the folder (and
    its parents) when missing."""
    folder, _, problem = not_a_folder(path)
    if problem:
        return problem
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)  # the cache is trusted code: private when made here
        write_probe(folder)
    except OSError as e:
        return f"cannot be written in ({type(e).__name__}: {e.strerror or e})"
    return None


def _set(values) -> None:
    for name, value in values.items():
        jax.config.update(name, value)
    _jax_cache.reset_cache()  # JAX opens its cache once per process: the next compile reads the settings again


def enable_compilation_cache(path: str | os.PathLike | None = None, *, fix: str = FIX) -> Path | None:
    """Keep every program JAX compiles from now on in ``path`` (default: :func:`default_cache_dir`, created if
    missing), and load it from there instead of compiling it when this or a later process runs it again.

    Process-wide, as JAX's own ``jax_compilation_cache_dir`` setting (which this sets, with the thresholds that keep
    small and quickly compiled programs too). Programs this process compiled before are in its memory already and
    are written to the folder only if compiled again. Returns the folder, or ``None`` with a :class:`CacheWarning`
    (saying ``fix``) when ``path`` cannot hold the cache (:func:`cache_folder_problem`); JAX's settings are then
    left as they were.

    >>> import eqxdiff
    >>> eqxdiff.enable_compilation_cache()  # ~/.cache/eqxdiff/jax
    >>> pipe = eqxdiff.load_pipeline("digits")  # the second process to run this compiles (almost) nothing
    """
    folder = default_cache_dir() if path is None else Path(path).expanduser()
    problem = cache_folder_problem(folder)
    if problem is not None:
        warnings.warn(f"the compilation cache folder {os.fspath(folder)!r} {problem}; running without the "
                      f"persistent compilation cache, so every program compiles ({fix})", CacheWarning, stacklevel=2)
        return None
    folder = Path(os.path.abspath(folder))
    _set({"jax_compilation_cache_dir": os.fspath(folder), **_EVERY_PROGRAM})
    return folder


@contextlib.contextmanager
def compilation_cache(path: str | os.PathLike | None = None, *, enabled: bool = True, fix: str = FIX):
    """Within the block, the persistent compilation cache in ``path`` (:func:`enable_compilation_cache`), or none
    when ``enabled`` is false (also a cache JAX's own settings asked for); JAX's settings as they were after it. What
    a command's ``main`` runs in: the process-wide setting is the command's, not its caller's. Yields the folder used
    (``None``: uncached)."""
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    try:
        if enabled:
            yield enable_compilation_cache(path, fix=fix)
        else:
            _set({"jax_enable_compilation_cache": False})
            yield None
    finally:
        _set(before)
