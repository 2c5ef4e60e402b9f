"""Multi-host for real: two CPU processes (4 simulated devices each) as one JAX distributed system.

Each process (``tests/_multihost_worker.py``) starts from ``EQXDIFF_COORDINATOR``, ``EQXDIFF_NUM_PROCESSES``,
``EQXDIFF_PROCESS_ID`` as the README's Scaling section says, builds a mesh whose dcn axis spans the processes,
loads a tiny diffusers UNet onto it, assembles the global batch from its own rows and takes a jitted loss +
gradient. Both processes' gathered results must agree with each other (exactly: one all-gathered array) and with
one device here, as accurately as the one-device run is against its float64 run (the float32 rounding of XLA's CPU
kernels differs between CPUs: FMA contraction, vector-width blocking; so no fixed bound).
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxdiff
from eqxdiff.parallel import MeshConfig, MeshError, initialize_distributed
from eqxdiff.parallel._mesh import _num_slices

from ._multihost_worker import CASES, CONTEXT, LATENT, global_batch, loss_and_grads
from ._tiny_sd import randomize_
from ._util import assert_close_to_float64, assert_leaves_close_to_float64, run_float64

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # the whole two-process run; a hang (a process waiting on a dead peer) fails instead of blocking
# Both processes and the reference compile the small UNet at once on a shared CPU: skip LLVM's expensive passes
# (numerics unchanged, compile time down by about a third).
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
WORKER_XLA_FLAGS = "--xla_force_host_platform_device_count=4 " + " ".join(
    f"--{k}={str(v).lower()}" for k, v in COMPILER_OPTIONS.items())


@pytest.fixture(scope="module")
def unet_folder(tmp_path_factory):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(
        sample_size=LATENT[0], in_channels=LATENT[2], out_channels=LATENT[2], block_out_channels=(16,),
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",),
        mid_block_type=None, cross_attention_dim=CONTEXT[1], attention_head_dim=4, norm_num_groups=8)
    randomize_(unet)
    folder = tmp_path_factory.mktemp("multihost") / "unet"
    unet.save_pretrained(folder)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start_workers(folder: Path, out: Path) -> list[tuple[subprocess.Popen, Path]]:
    port = _free_port()
    workers = []
    for pid in range(2):
        env = {**os.environ, "EQXDIFF_COORDINATOR": f"localhost:{port}", "EQXDIFF_NUM_PROCESSES": "2",
               "EQXDIFF_PROCESS_ID": str(pid), "XLA_FLAGS": WORKER_XLA_FLAGS, "JAX_PLATFORMS": "cpu"}
        log = out / f"process{pid}.log"
        with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall the worker
            proc = subprocess.Popen([sys.executable, "-m", "tests._multihost_worker", str(folder), str(out)],
                                    cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        workers.append((proc, log))
    return workers


def _wait(workers) -> None:
    """Wait for both; when one fails or time runs out, stop the other (it would wait on its dead peer)."""
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p, _ in workers):
        failed = any(p.poll() not in (None, 0) for p, _ in workers)
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for p, _ in workers:
        if p.poll() is None:
            p.kill()
            p.wait()
    logs = "\n".join(f"--- process {i} (exit {p.returncode}):\n"
                     + "\n".join(line for line in log.read_text().splitlines() if "[Gloo]" not in line)[-4000:]
                     for i, (p, log) in enumerate(workers))
    if any(p.returncode != 0 for p, _ in workers):
        pytest.fail(f"a worker failed or ran past {TIMEOUT_S} s:\n{logs}")


@pytest.mark.slow
def test_two_processes_equal_one_device(unet_folder, tmp_path):
    workers = _start_workers(unet_folder, tmp_path)
    try:  # the single-device reference while the workers run
        params, static = eqx.partition(eqxdiff.load(unet_folder), eqx.is_array)
        batch = {k: jnp.asarray(v) for k, v in global_batch().items()}
        loss = lambda p, b: loss_and_grads(eqx.combine(p, static), b)  # noqa: E731
        expected = _named(*jax.jit(loss, compiler_options=COMPILER_OPTIONS)(params, batch))
    finally:
        _wait(workers)
    expected64 = _named(*run_float64(loss, params, batch))  # after the workers: they run against a time limit

    for case in CASES:
        results = [dict(np.load(tmp_path / f"{case}_p{pid}.npz")) for pid in range(2)]
        for name in results[0]:  # both processes gathered the same global values: one array, exactly
            np.testing.assert_array_equal(results[0][name], results[1][name], err_msg=f"{case}: {name}")
        assert results[0].keys() == expected.keys(), f"{case}: {sorted(results[0].keys() ^ expected.keys())}"
        for name in ("loss", "prediction"):
            assert_close_to_float64(results[0][name], expected[name], expected64[name],
                                    what=f"{case}: {name} against one device")
        grads = [{k: v for k, v in tree.items() if k.startswith("grad")} for tree in (results[0], expected, expected64)]
        assert_leaves_close_to_float64(*grads, what=f"{case}: against one device,")


def _named(value_and_prediction, grads) -> dict[str, np.ndarray]:
    """``{"loss", "prediction", "grad<path>"...}`` of :func:`loss_and_grads`' outputs, as the workers write them."""
    (loss, prediction), grads = value_and_prediction, eqx.filter(grads, eqx.is_array)
    named = {"loss": np.asarray(loss), "prediction": np.asarray(prediction)}
    return named | {f"grad{jax.tree_util.keystr(k)}": np.asarray(v)
                    for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]}


def _devices(platform, slices, processes):
    return [SimpleNamespace(platform=platform, slice_index=s, process_index=p) for s, p in zip(slices, processes)]


@pytest.mark.parametrize("devices, granules", [
    (_devices("cpu", [0, 0, 0, 0], [0, 0, 1, 1]), 2),  # CPUs say slice 0 on every host: processes are the granules
    (_devices("cpu", [None] * 4, [0, 0, 1, 1]), 2),
    (_devices("tpu", [0, 0, 0, 0], [0, 0, 1, 1]), 1),  # one TPU slice over two hosts: all of it is ici
    (_devices("tpu", [0, 0, 1, 1], [0, 1, 2, 3]), 2),  # two TPU slices
])
def test_dcn_granules(devices, granules):
    assert _num_slices(devices) == granules
    # dcn_data_parallelism=-1 fills the granule count, the ici sizes fill each granule
    assert MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1).mesh_shape(4, granules)["data"] == granules


@pytest.mark.parametrize("given", [("EQXDIFF_COORDINATOR",), ("EQXDIFF_NUM_PROCESSES",),
                                   ("EQXDIFF_COORDINATOR", "EQXDIFF_PROCESS_ID")])
def test_initialize_distributed_names_missing_environment(monkeypatch, given):
    values = {"EQXDIFF_COORDINATOR": "localhost:1234", "EQXDIFF_NUM_PROCESSES": "2", "EQXDIFF_PROCESS_ID": "0"}
    names = {"EQXDIFF_COORDINATOR": "coordinator_address", "EQXDIFF_NUM_PROCESSES": "num_processes",
             "EQXDIFF_PROCESS_ID": "process_id"}
    for var, value in values.items():
        if var in given:
            monkeypatch.setenv(var, value)
        else:
            monkeypatch.delenv(var, raising=False)
    missing = [names[v] for v in values if v not in given]
    with pytest.raises(MeshError, match=f"but not {missing!r}".replace("[", r"\[").replace("]", r"\]")):
        initialize_distributed()
