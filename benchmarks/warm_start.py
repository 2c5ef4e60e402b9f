"""A warm start: the README's generate command run twice in a fresh compilation cache folder, and ``import eqxdiff``
plus ``eqxdiff.load_pipeline("digits")`` in fresh processes.

    python benchmarks/warm_start.py                  # 2 runs of the command, 7 import + load processes
    python benchmarks/warm_start.py --pairs 3 --loads 11

Each pair of runs gets a new ``XDG_CACHE_HOME`` (so the command's default cache folder, ``$XDG_CACHE_HOME/eqxdiff/jax``,
starts empty) and a new working folder for the images. For each run: the wall time of the whole process (interpreter
start to exit), the compile seconds the command prints (``pipe.timings``: tracing, lowering and XLA's compile or its
cache read, within the pipeline call) and JAX's own counts of the process (programs compiled by XLA and written to
the cache; programs read from the cache). The goal: the second run compiles for under 1 s and takes at most half the
first run's wall time. The CPU seconds (user + system of the process) say the same less affected by other work on a
shared machine. Then ``--loads`` fresh processes time ``import eqxdiff`` plus ``load_pipeline("digits")`` (goal:
median at most 1.5 s; one untimed process first) and one more runs it under ``-X importtime`` to list what the time
goes to. Every process runs with Python's default of writing bytecode (``PYTHONDONTWRITEBYTECODE`` is dropped from
the environment: set, as on this project's machines, each process would compile eqxdiff's modules again, about 0.3 s).
"""

import dataclasses
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tyro

from _bench import host_cpu

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ["scripts/generate.py", "--prompt", "a handwritten digit seven", "--num-images", "4"]
# The command as the README gives it, with JAX's event counts printed at exit (a listener costs nothing measurable).
_COUNTING = """
import atexit, runpy, sys, jax
counts = {"compiled": 0, "written": 0, "read": 0}
names = {"/jax/compilation_cache/cache_misses": "written", "/jax/compilation_cache/cache_hits": "read"}
def on_event(name, **kwargs):
    if name in names:
        counts[names[name]] += 1
def on_duration(name, seconds, **kwargs):
    if name == "/jax/core/compile/backend_compile_duration":
        counts["compiled"] += 1
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
atexit.register(lambda: print("counts:", counts, file=sys.stderr))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
_LOAD = ("import time; t, c = time.perf_counter(), time.process_time(); import eqxdiff; "
         "eqxdiff.load_pipeline('digits'); print(time.perf_counter() - t, time.process_time() - c)")


@dataclasses.dataclass(frozen=True)
class Args:
    pairs: int = 1
    """Pairs of runs (first and second) of the generate command, each pair in a fresh cache folder."""
    loads: int = 7
    """Fresh processes timing import eqxdiff + load_pipeline("digits") (the median is reported)."""
    top: int = 12
    """Imports listed from -X importtime (largest cumulative time first)."""


def _env(**extra) -> dict:
    env = {**os.environ, **extra}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as on a user's machine: modules are compiled to bytecode once, then read
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _cpu_seconds() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _run_command(work: Path, cache_home: Path) -> dict:
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    out = subprocess.run([sys.executable, "-c", _COUNTING, str(ROOT / COMMAND[0]), *COMMAND[1:]], cwd=work,
                         env=_env(XDG_CACHE_HOME=str(cache_home)), capture_output=True, text=True, check=True)
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    compile_s = float(re.search(r"compile: ([\d.]+) s", out.stderr).group(1))
    counts = eval(re.search(r"counts: (\{.*\})", out.stderr).group(1))  # noqa: S307 - our own printed dict
    return {"wall": wall, "cpu": cpu, "compile": compile_s, **counts}


def command_pairs(pairs: int) -> list[tuple[dict, dict]]:
    results = []
    for _ in range(pairs):
        with tempfile.TemporaryDirectory() as tmp:
            work, cache_home = Path(tmp, "work"), Path(tmp, "cache")
            work.mkdir()
            results.append((_run_command(work, cache_home), _run_command(work, cache_home)))
    return results


def load_times(n: int) -> list[tuple[float, float]]:
    """``(wall, cpu)`` seconds of import + load in ``n`` fresh processes."""
    runs = [subprocess.run([sys.executable, "-c", _LOAD], env=_env(), capture_output=True, text=True, check=True)
            for _ in range(n + 1)][1:]  # the first, untimed, writes the bytecode of modules that have none yet
    return [tuple(map(float, run.stdout.split())) for run in runs]


def import_times(top: int) -> list[tuple[float, str]]:
    """The largest cumulative import times (s) of one import + load under ``-X importtime``, packages only."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", _LOAD], env=_env(), capture_output=True,
                         text=True, check=True)
    rows = []
    for line in out.stderr.splitlines():
        found = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)", line)
        if found and found.group(3).count(".") <= 1:
            rows.append((int(found.group(1)) / 1e6, found.group(3)))
    return sorted(rows, reverse=True)[:top]


def main(args: Args) -> None:
    print(f"CPU: {host_cpu()}, {os.cpu_count()} cores; load average before: {os.getloadavg()[0]:.1f}")
    print(f"command: python {' '.join(COMMAND[:2])} {COMMAND[2]!r} {' '.join(COMMAND[3:])}")
    print("| run | wall (s) | CPU (s) | compile (s) | XLA compiles | written to cache | read from cache |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for first, second in command_pairs(args.pairs):
        for name, r in (("first", first), ("second", second)):
            print(f"| {name} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['compile']:.2f} | {r['compiled'] - r['read']} | "
                  f"{r['written']} | {r['read']} |")
        ok = second["compile"] < 1.0 and second["wall"] <= first["wall"] / 2
        print(f"| second / first | {second['wall'] / first['wall']:.2f} | {second['cpu'] / first['cpu']:.2f} | | | | "
              f"| goal {'met' if ok else 'missed'}")
    times = load_times(args.loads)
    walls, cpus = [w for w, _ in times], [c for _, c in times]
    print(f"import eqxdiff + load_pipeline('digits'), {args.loads} fresh processes: median "
          f"{statistics.median(walls):.2f} s wall (min {min(walls):.2f}, max {max(walls):.2f}), "
          f"{statistics.median(cpus):.2f} s CPU; load average after: {os.getloadavg()[0]:.1f}")
    print("-X importtime, cumulative (s): " + ", ".join(f"{name} {s:.2f}" for s, name in import_times(args.top)))


if __name__ == "__main__":
    main(tyro.cli(Args))
