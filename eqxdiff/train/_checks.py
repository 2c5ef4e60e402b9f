"""The value check the train configs share (their ``__post_init__``): a setting that must be one of a few names."""

from collections.abc import Collection


def check_choice(name: str, value, choices: Collection) -> None:
    """``ValueError`` naming ``name``, the ``value`` given and the ``choices`` unless ``value`` is one of them
    (``schedule='step'; choose one of ['constant', 'cosine', 'linear']``)."""
    if value not in choices:
        raise ValueError(f"{name}={value!r}; choose one of {list(choices)}")
