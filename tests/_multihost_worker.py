"""One process of the two-process CPU run in ``tests/test_multihost.py``.

Started as ``python -m tests._multihost_worker UNET_FOLDER OUT_DIR`` with ``EQXDIFF_COORDINATOR``,
``EQXDIFF_NUM_PROCESSES``, ``EQXDIFF_PROCESS_ID`` set (as the README tells users) and 4 simulated CPU devices per
process. For each mesh case it loads the UNet onto the mesh, assembles the global batch from this host's rows, takes
one jitted loss + gradient and writes the loss, the model output and every gradient leaf (gathered to full
values) to ``OUT_DIR/{case}_p{process}.npz``. The test runs the same :func:`loss` on one device and compares.
"""

import sys
import time

import numpy as np

_START = time.perf_counter()
GLOBAL_BATCH = 8
LATENT = (8, 8, 4)  # height, width, channels of the tiny UNet's input
CONTEXT = (6, 16)  # tokens, cross_attention_dim

# name -> MeshConfig keywords; both put "data" x "fsdp" = 2 x 4 or 1 x 8 over the 2 processes x 4 devices.
CASES = {
    # the README's layout: FSDP within a host, data parallel across hosts
    "dcn_data": dict(ici_data_parallelism=1, ici_fsdp_parallelism=-1, dcn_data_parallelism=-1),
    # FSDP across hosts too: every host holds (and reads) only half of each sharded parameter
    "dcn_fsdp": dict(ici_data_parallelism=1, ici_fsdp_parallelism=-1, dcn_data_parallelism=1,
                     dcn_fsdp_parallelism=-1),
}


def global_batch() -> dict[str, np.ndarray]:
    """The whole batch, the same in every process and in the single-device reference."""
    rng = np.random.default_rng(0)
    return {"latents": rng.standard_normal((GLOBAL_BATCH, *LATENT), dtype=np.float32),
            "noise": rng.standard_normal((GLOBAL_BATCH, *LATENT), dtype=np.float32),
            "context": rng.standard_normal((GLOBAL_BATCH, *CONTEXT), dtype=np.float32),
            "timesteps": rng.integers(0, 1000, GLOBAL_BATCH).astype(np.int32)}


def loss(unet, batch):
    """Mean squared error of the UNet's prediction against the noise; the prediction is returned too."""
    import jax.numpy as jnp

    prediction = unet(batch["latents"], batch["timesteps"], batch["context"])
    return jnp.mean((prediction - batch["noise"]) ** 2), prediction


def loss_and_grads(unet, batch):
    import equinox as eqx

    return eqx.filter_value_and_grad(loss, has_aux=True)(unet, batch)


def flat(tree) -> dict[str, np.ndarray]:
    """``{key path: numpy value}`` of a pytree's array leaves (gathered: the values are full, not this host's)."""
    import equinox as eqx
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


def _check_mesh(mesh, case: str) -> None:
    import jax

    processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
    axis = "data" if case == "dcn_data" else "fsdp"
    expected = {"dcn_data": {"data": 2, "fsdp": 4}, "dcn_fsdp": {"data": 1, "fsdp": 8}}[case]
    assert {a: mesh.shape[a] for a in ("data", "fsdp")} == expected, dict(mesh.shape)
    # the dcn axis spans the processes: moving along it changes process, the other axes stay within one
    first = np.moveaxis(processes, mesh.axis_names.index(axis), 0)
    first = first.reshape(first.shape[0], -1) if axis == "data" else first.reshape(2, -1)
    assert all(len(set(row)) == 1 for row in first), processes
    assert sorted(first[:, 0]) == [0, 1], processes
    assert jax.process_index() in processes


def _log(msg: str) -> None:
    import jax

    print(f"[process {jax.process_index()} {time.perf_counter() - _START:6.1f}s] {msg}", flush=True)


def run_case(case: str, folder: str, out_dir: str) -> None:
    import equinox as eqx
    import jax
    from jax.experimental import multihost_utils

    import eqxdiff
    from eqxdiff.data import to_global_batch
    from eqxdiff.parallel import MeshConfig, host_local_batch, make_mesh, shard_batch, sharding_fn

    mesh = make_mesh(MeshConfig(**CASES[case]))
    _check_mesh(mesh, case)
    pid = jax.process_index()

    _log(f"{case}: mesh {dict(mesh.shape)}")
    unet = eqxdiff.load(folder, sharding=sharding_fn(mesh))
    _log(f"{case}: loaded")
    local = {d for d in jax.local_devices()}
    params = [x for x in jax.tree_util.tree_leaves(eqx.filter(unet, eqx.is_array))]
    assert all(not x.is_fully_addressable and set(x.sharding.addressable_devices) == local for x in params)
    split = [x for x in params if x.sharding.spec and any(s is not None for s in x.sharding.spec)]
    assert split, "no parameter is sharded: the test would not exercise FSDP"
    if case == "dcn_fsdp":  # this host's devices hold (so it read) only half of a parameter split 8 ways
        x = max(split, key=lambda x: x.size)
        held = sum(s.data.size for s in x.addressable_shards)
        assert held == x.size // 2, (x.shape, x.sharding.spec, held)

    full = global_batch()
    # this host's rows: the hosts split the batch in process order (what eqxdiff.data.make_dataset gives each)
    per_host = GLOBAL_BATCH // jax.process_count()
    mine = {k: v[pid * per_host:(pid + 1) * per_host] for k, v in full.items()}

    def rows(name):
        def data(index):
            sl = index[0]
            assert pid * per_host <= sl.start and sl.stop <= (pid + 1) * per_host, (pid, index)
            return mine[name][sl.start - pid * per_host:sl.stop - pid * per_host]
        return data

    from_callback = {k: host_local_batch(v.shape, mesh, rows(k)) for k, v in full.items()}
    from_local = to_global_batch(mine, mesh)
    from_full = shard_batch(full, mesh)
    for k, v in full.items():
        for how, batches in (("host_local_batch", from_callback), ("to_global_batch", from_local),
                             ("shard_batch", from_full)):
            got = multihost_utils.process_allgather(batches[k], tiled=True)
            np.testing.assert_array_equal(got, v, err_msg=f"{how}: {k}")  # moved, not computed: exactly equal

    _log(f"{case}: batches checked")
    (value, prediction), grads = eqx.filter_jit(loss_and_grads)(unet, from_callback)
    # the forward ran split over the batch: each device holds one row of the prediction
    assert {s.data.shape[0] for s in prediction.addressable_shards} == {GLOBAL_BATCH // jax.device_count()}
    _log(f"{case}: loss and gradients")
    gathered = multihost_utils.process_allgather({"loss": value, "prediction": prediction}, tiled=True)
    grads = flat(multihost_utils.process_allgather(eqx.filter(grads, eqx.is_array), tiled=True))
    np.savez(f"{out_dir}/{case}_p{pid}.npz", loss=gathered["loss"], prediction=gathered["prediction"],
             **{f"grad{k}": v for k, v in grads.items()})
    _log(f"{case}: written")


def main(folder: str, out_dir: str, *cases: str) -> None:
    import jax

    from eqxdiff.parallel import initialize_distributed

    jax.config.update("jax_default_matmul_precision", "highest")
    initialize_distributed()  # EQXDIFF_COORDINATOR, EQXDIFF_NUM_PROCESSES, EQXDIFF_PROCESS_ID
    _log("initialized")
    assert jax.process_count() == 2, jax.process_count()
    assert jax.device_count() == 8 and jax.local_device_count() == 4, (jax.device_count(), jax.local_device_count())
    for case in cases or tuple(CASES):
        run_case(case, folder, out_dir)
    _log("done")


if __name__ == "__main__":
    main(*sys.argv[1:])
