"""What both console commands do around their ``main``: one way to report.

- A user error (a bad flag value, model or input file: ``ValueError`` and its typed subclasses ``CheckpointError``,
  ``ConfigError``, ``MeshError``, ``DataError``, ``InputError``...; or ``OSError``) prints one line
  ``error: <what> (<how to fix>)`` on stderr and exits with status 2.
- Out of memory prints which settings lower memory and exits with status 1; so does a model that produced NaN.
- Ctrl-C exits with status 130; a run stopped by a signal (``eqxdiff-train``'s ``TrainingInterrupted``, given as
  ``interrupted``) says where its checkpoint is, in one line.
- Warnings print as one ``warning: ...`` line each, each text once (a check run before loading and again by the
  pipeline warns once).
- ``--debug`` (anywhere on the command line) shows the full traceback and Python's own warning format instead.

Both run with the persistent compilation cache on (:class:`CacheOptions`, :func:`eqxdiff.core.compilation_cache`).
"""

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import tyro._errors

from ..core import compilation_cache, not_a_folder, write_probe
from ..pipelines import InputError, NonFiniteError

DEBUG_FLAG = "--debug"
DEBUG_HELP = f"{DEBUG_FLAG} shows the full traceback of an error."
# What XLA says when a buffer does not fit (GPU, TPU and CPU wordings).
_OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM when allocating")


class FlagError(ValueError):
    """A flag value that the config it builds refused (the message is that config's)."""


CACHE_FIX = "pass --compilation-cache-dir with a folder you can write in, or --no-compilation-cache"


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """The persistent compilation cache: compiled programs kept on disk, so that a later run loads them."""

    compilation_cache_dir: Path | None = None
    """Folder of the persistent compilation cache, where compiled programs are kept so that later runs load them
    instead of compiling; default: $XDG_CACHE_HOME/eqxdiff/jax, else ~/.cache/eqxdiff/jax. One that cannot be
    written in is a warning, and the run goes on uncached."""
    compilation_cache: bool = True
    """Keep compiled programs in the cache folder and load them from there; --no-compilation-cache compiles
    everything and writes nothing."""

    def __post_init__(self):
        if self.compilation_cache_dir is not None and not self.compilation_cache:
            raise InputError("--compilation-cache-dir and --no-compilation-cache contradict each other; leave one "
                             "out")

    def scope(self):
        """The context a command's work runs in: the cache on (or off) within it, JAX's settings as they were
        after it (:func:`eqxdiff.core.compilation_cache`); a folder that cannot hold it is one warning."""
        return compilation_cache(self.compilation_cache_dir, enabled=self.compilation_cache, fix=CACHE_FIX)


CACHE_HELP = ("--compilation-cache-dir DIR keeps compiled programs in DIR (default: $XDG_CACHE_HOME/eqxdiff/jax, "
              "else ~/.cache/eqxdiff/jax) so that later runs skip compiling; --no-compilation-cache turns it off.")


def split_cache_flags(argv: Sequence[str]) -> tuple[CacheOptions, list[str]]:
    """``(options, rest)``: the cache flags (:class:`CacheOptions`, anywhere on the command line) and the other
    arguments. Both commands read them first, to have the cache on from the checks' first program on;
    ``eqxdiff-train`` parses the rest (its parser, built from its config, does not hold them)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--compilation-cache-dir", type=lambda v: None if v == "None" else Path(v))  # as tyro
    parser.add_argument("--compilation-cache", action=argparse.BooleanOptionalAction, default=True)
    try:
        known, rest = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as e:
        raise FlagError(f"{e.argument_name or 'a flag'}: {e.message}; --help shows its form") from None
    return CacheOptions(known.compilation_cache_dir, known.compilation_cache), rest


def _flag(argument) -> str:
    try:
        return argument.display_name()
    except AttributeError:
        return "a flag"


def _choices(event) -> list[str]:
    """A flag's choices in the order ``--help`` lists them (its metavar, ``{ddim,pndm,...}``), without ``None``: an
    optional flag's default, which leaving the flag out gives."""
    choices = [c for c in event.choices if c != "None"]
    try:
        listed = str(event.argument.lowered.metavar or "").strip("{}").split(",")
    except AttributeError:
        listed = []
    return [c for c in listed if c in choices] + [c for c in choices if c not in listed]


@contextlib.contextmanager
def config_errors_raise():
    """Within the block, ``tyro.cli``'s usage errors raise instead of drawing tyro's error box, so the command
    reports them in one line: a config its flags cannot build (its ``__post_init__`` raised ``ValueError``) raises
    that error; an unknown flag, a value outside a flag's choices, a flag missing its value or a missing required
    flag raise :class:`FlagError`. Other events keep tyro's box. (tyro's parse-error hook:
    ``tyro._errors.on_parse_error``.)"""
    errors = tyro._errors

    def hook(event):
        if isinstance(event, errors.InstantiationFailure):
            cause = sys.exc_info()[1]
            cause = getattr(cause, "__context__", None) or cause
            raise cause if isinstance(cause, ValueError) else FlagError(event.message)
        if isinstance(event, errors.InvalidChoice):
            raise FlagError(f"{_flag(event.argument)} {event.value!r} is not one of its choices; choose one of "
                            f"{', '.join(_choices(event))}")
        if isinstance(event, errors.UnrecognizedArgs):
            raise FlagError(f"unrecognized argument(s) {' '.join(event.tokens)}; --help lists the flags")
        if isinstance(event, errors.BadValue):
            given = "" if event.offending_value is None else f" {event.offending_value!r}"
            raise FlagError(f"{_flag(event.argument)}{given}: wrong number of values; --help shows its form")
        if isinstance(event, errors.MissingArgs):
            names = ", ".join(_flag(a.arg) for a in event.missing_arguments)
            raise FlagError(f"missing required flag(s) {names}")
        if isinstance(event, errors.MissingSubcommand):
            names = ", ".join(event.subcommand_spec.parser_from_name)
            given = "" if event.found_token is None else f"{event.found_token!r} is not one of them; "
            raise FlagError(f"name one of {names} first ({given}--help describes each)")

    with tyro._errors.on_parse_error(hook):
        yield


def one_line(text: str) -> str:
    """``text`` on one line: its lines joined with ``; `` (or a space after a colon or a full stop)."""
    parts = [line.strip() for line in str(text).splitlines() if line.strip()]
    out = parts[0] if parts else ""
    for part in parts[1:]:
        out += (" " if out.endswith((":", ".", ";")) else "; ") + part
    return out


def is_out_of_memory(error: BaseException) -> bool:
    return type(error).__name__ in ("XlaRuntimeError", "JaxRuntimeError") and any(
        s in str(error) for s in _OUT_OF_MEMORY)


def python_flag(name: str) -> str:
    """The flag of the Python argument ``name``: dashes for underscores, diffusers' underscore-led names without the
    underscore (Kontext's ``_auto_resize``: ``--auto-resize``)."""
    return "--" + name.lstrip("_").replace("_", "-")


def as_flags(message: str, names, flags: Mapping[str, str] | None = None, python_only=()) -> str:
    """``message`` (about a call's arguments or a config's fields: ``height=0``, ``pass image=``, ``needs
    remat_names``) in the command's words (``--height 0``, ``pass --image``, ``needs --remat-names``); ``flags``
    gives the flag of a name whose flag is not ``--`` and the name with ``-`` for ``_`` (a nested config's field:
    ``{"learning_rate": "--optimizer.learning-rate"}``). ``python_only``: arguments the command line cannot give (a
    call's arrays: ``latents``); an alternative naming one (``pass video= (...) or latents= (...)``) is dropped."""
    flags = dict(flags or {})
    for name in python_only:
        message = re.sub(rf",? or {re.escape(name)}=(?: \([^()]*\))?", "", message)
    for name in sorted({*names, *flags}, key=len, reverse=True):
        flag = flags.get(name) or python_flag(name)
        word = rf"(?<![\w.-]){re.escape(name)}"
        message = re.sub(rf"{word}=(?=[^\s,;)])", flag + " ", message)
        message = re.sub(rf"{word}=", flag, message)
        message = re.sub(rf"{word}(?= (?:must|applies|is|has|needs|unset|0 to|\[))", flag, message)
        message = re.sub(rf"\b(raise|needs|use|lower) {re.escape(name)}(?![\w.-])", rf"\1 {flag}", message)
    return message


def check_output_folder(flag: str, path) -> None:
    """``path`` (given as ``flag``) can be the folder a command writes into: it is a folder, or it is missing and
    its nearest existing ancestor is a folder; this process makes it (when missing) and a file in it, then removes
    what it made (``os.access`` answers yes to root, even on a read-only mount or under /proc). Checked before
    minutes of loading, compiling or training, whose results would be lost when the folder cannot be made; raises
    :class:`~eqxdiff.pipelines.InputError` naming the flag and the fix."""
    given = os.fspath(path)
    absolute, existing, where = not_a_folder(path)
    if where:
        raise InputError(f"{flag} {given!r} {where}; pass a folder (created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {given!r}: no permission to write in {os.fspath(existing)!r}; pass a folder you "
                         "can write to")
    problem = _write_probe(absolute, existing)
    if problem:
        raise InputError(f"{flag} {given!r} {problem}; pass a folder you can write to")


def _write_probe(folder: Path, existing: Path) -> str | None:
    """Make ``folder`` (its missing parents below ``existing`` too) and a file in it, then remove all that was made
    and give ``existing`` its modification time back; why that failed (``"cannot be created (FileNotFoundError:
    ...)"``), or ``None``."""
    missing = [folder, *folder.parents][:len(folder.parts) - len(existing.parts)]
    made, doing, before = [], "created", existing.stat()
    try:
        for part in reversed(missing):
            part.mkdir()
            made.append(part)
        doing = "written in"
        write_probe(folder)
    except OSError as e:
        return f"cannot be {doing} ({type(e).__name__}: {e.strerror or e})"
    finally:
        for part in reversed(made):
            with contextlib.suppress(OSError):  # another process may have written there meanwhile: keep it
                part.rmdir()
        with contextlib.suppress(OSError):
            os.utime(existing, ns=(before.st_atime_ns, before.st_mtime_ns))
    return None


@contextlib.contextmanager
def _one_line_warnings():
    shown = set()  # a warning the checks before loading gave is not repeated when the pipeline's checks give it

    def show(message, category, filename, lineno, file=None, line=None):
        text = f"warning: {one_line(str(message))}"
        if text not in shown:
            shown.add(text)
            print(text, file=sys.stderr if file is None else file)

    previous = warnings.showwarning
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def run_command(main: Callable[..., object], argv: Sequence[str] | None = None, *, memory_hint: str = "",
                interrupted: type[BaseException] | tuple[type[BaseException], ...] = ()) -> None:
    """Run ``main(argv, prog=...)`` (``argv``: default ``sys.argv[1:]``, without ``--debug``) and report as the
    module docstring says; ``memory_hint`` lists the command's settings that lower memory, ``interrupted`` the
    errors that mean its work was stopped by a signal and say what was kept (``eqxdiff-train`` passes
    ``TrainingInterrupted``; naming it here would import the training stack into ``eqxdiff-generate``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv
    argv = [a for a in argv if a != DEBUG_FLAG]
    prog = Path(sys.argv[0]).name
    if debug:
        main(argv, prog=prog)
        return
    try:
        with _one_line_warnings():
            main(argv, prog=prog)
    except BrokenPipeError:  # stdout piped into a command that stopped reading (`--help | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    except interrupted as e:
        print(one_line(str(e)), file=sys.stderr)
        raise SystemExit(130) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except NonFiniteError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        raise SystemExit(1) from None
    except (ValueError, OSError) as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        first = one_line(str(e).split("\n", 1)[0])[:300]
        print(f"error: out of memory ({first}); to lower memory: {memory_hint or 'use smaller inputs'}",
              file=sys.stderr)
        raise SystemExit(1) from None
