"""A progress bar that a sampling loop advances.

:func:`~eqxdiff.pipelines.denoise_loop` calls ``tick()`` after each step (run one compiled call at a time, not by a
host callback inside the loop, which would keep JAX from caching the program on disk); ``tick`` advances whatever bar
the enclosing :func:`progress_bar` context opened. Outside such a context the ticks do nothing.
"""

import contextlib

from tqdm.auto import tqdm

_bars: list = []


def tick() -> None:
    if _bars:
        _bars[-1].update(1)


@contextlib.contextmanager
def progress_bar(total: int, desc: str, enabled: bool = True):
    bar = tqdm(total=total, desc=desc, disable=not enabled, leave=False)
    _bars.append(bar)
    try:
        yield bar
    finally:
        _bars.remove(bar)
        bar.close()
