"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision, jaxtyping + beartype checks on, a cache
folder (XDG_CACHE_HOME) of the session's, holding the session's persistent compilation cache."""

import atexit
import os
import shutil
import tempfile

# Append to XLA_FLAGS set outside (a setdefault would drop the 8 devices); a count set there is kept.
_xla_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _xla_flags:
    os.environ["XLA_FLAGS"] = f"{_xla_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# eqxdiff's commands keep compiled programs in the user's cache folder by default ($XDG_CACHE_HOME/eqxdiff/jax, else
# ~/.cache/eqxdiff/jax): the suite and its subprocesses use a folder of the session's (removed at exit), never the
# user's. Hugging Face's caches stay where they were.
_user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
os.environ.setdefault("HF_HOME", os.path.join(_user_cache, "huggingface"))
# With pytest-xdist (``-n 2``) the workers inherit the controller's folder (the controller loads this file first and
# starts them after), so they share one compilation cache as two processes may; the controller removes it at exit.
if "PYTEST_XDIST_WORKER" not in os.environ or "EQXDIFF_TESTS_CACHE" not in os.environ:
    os.environ["EQXDIFF_TESTS_CACHE"] = tempfile.mkdtemp(prefix="eqxdiff-tests-cache-")
    atexit.register(shutil.rmtree, os.environ["EQXDIFF_TESTS_CACHE"], ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = os.environ["EQXDIFF_TESTS_CACHE"]

import gc  # noqa: E402
import random  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# The session's compiled programs go to its cache folder (eqxdiff's persistent cache, every program): tests that build
# the same tiny models in their own fixtures read each other's programs instead of compiling them again (the training
# tests' steps: about a fifth of their time). Tests of the cache itself set and restore their own folders.
import eqxdiff  # noqa: E402

eqxdiff.enable_compilation_cache()
# Shared test bases: pytest rewrites their asserts too, so a failure shows the values compared.
pytest.register_assert_rewrite("tests._parity", "tests._util")


def pytest_collection_modifyitems(items):
    """Mark ``slow`` the checks tests/_slow.py lists (the README's default test command leaves them out)."""
    import re

    from tests._slow import SLOW

    patterns = [re.compile(p) for p in SLOW.values()]
    for item in items:
        if any(p.search(item.nodeid) for p in patterns):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test module, drop JAX's caches of compiled programs (a module's tests share theirs; later modules
    do not reuse them). XLA:CPU maps each executable's machine code into its own memory areas, and the whole suite's
    programs kept alive in one process passed Linux's default limit of 65530 mappings (vm.max_map_count): the next
    compile then crashed with a segmentation fault."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def getkey():
    """A function returning fresh PRNG keys; prints the seed so a failure can be replayed."""
    seed = random.randint(0, 2**31 - 1)
    print(f"getkey seed: {seed}")
    key = [jax.random.key(seed)]

    def _next():
        key[0], sub = jax.random.split(key[0])
        return sub

    return _next
