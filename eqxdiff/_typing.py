"""Shape-typed aliases and the runtime checker used on every public signature.

Glossary of dimension names used across eqxdiff:

- ``batch``: samples in a batch.
- ``height``, ``width``: spatial size (pixels or latents); ``frames`` for video.
- ``channels``: feature channels, always the last axis (channels-last layout).
- ``seq`` / ``q_seq`` / ``kv_seq``: token sequence lengths; ``heads``, ``head_dim``: attention heads.
- ``embed``: hidden size of a transformer; ``text_seq``: text tokens; ``text_embed``: text hidden size.

Checks run with ``jaxtyped(typechecker=beartype)``: at trace time, so they cost nothing under ``jit``.
"""

from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray, Shaped, jaxtyped

__all__ = ["Array", "Bool", "Float", "Int", "Key", "PRNGKeyArray", "Shaped", "typechecked"]


def typechecked(fn):
    """Decorate ``fn`` so jaxtyping shapes are checked with beartype whenever it is called or traced."""
    return jaxtyped(typechecker=beartype)(fn)
