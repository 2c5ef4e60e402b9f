"""A progress bar that a jitted sampling loop can advance.

The loop calls ``jax.debug.callback(tick, i)`` each step; ``tick`` advances whatever bar the enclosing
:func:`progress_bar` context opened on the host. Outside such a context the ticks do nothing.
"""

import contextlib

from tqdm.auto import tqdm

_bars: list = []


def tick(step) -> None:
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
