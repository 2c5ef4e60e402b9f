"""In-memory datasets: endless shuffled batches whose position is their whole state (exact resume)."""

from collections.abc import Mapping

import numpy as np

from ._common import DataError


class ArrayBatches:
    """Endless shuffled batches from in-memory arrays (one permutation per epoch, drawn from ``[seed, epoch]``).

    ``position`` (batches yielded so far) is the whole state: ``get_state``/``set_state`` checkpoint it, so a
    resumed run sees the same batches as one that never stopped. Drops the last partial batch of each epoch.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, *, seed: int = 0, position: int = 0):
        self.arrays = {k: np.asarray(v) for k, v in arrays.items()}
        n = {k: len(v) for k, v in self.arrays.items()}
        if not n or 0 in n.values():
            raise DataError(f"the dataset is empty: {n or 'no arrays'}")
        if len(set(n.values())) != 1:
            raise DataError(f"dataset arrays have different lengths: {n}")
        self.size = next(iter(n.values()))
        if not 1 <= batch_size <= self.size:
            raise DataError(f"batch_size={batch_size} must be in [1, dataset size {self.size}]")
        self.batch_size, self.seed, self.position = batch_size, seed, position

    @property
    def batches_per_epoch(self) -> int:
        return self.size // self.batch_size

    def __iter__(self):
        return self

    def indices(self, position: int) -> np.ndarray:
        epoch, i = divmod(position, self.batches_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
        return perm[i * self.batch_size:(i + 1) * self.batch_size]

    def __next__(self) -> dict[str, np.ndarray]:
        idx = self.indices(self.position)
        self.position += 1
        return {k: v[idx] for k, v in self.arrays.items()}

    def get_state(self) -> dict:
        return {"position": self.position, "seed": self.seed, "batch_size": self.batch_size}

    def set_state(self, state: Mapping) -> None:
        if int(state["batch_size"]) != self.batch_size or int(state["seed"]) != self.seed:
            raise DataError(f"the checkpoint's data iterator used batch_size={state['batch_size']}, "
                            f"seed={state['seed']}; this run has batch_size={self.batch_size}, seed={self.seed}")
        self.position = int(state["position"])
