"""One walk over a tree of modules, and the copy-with-changes that static fields need.

``eqx.tree_at`` reaches array leaves only; the run-time settings models carry (``plan``, attention
``implementation``) and the layout of repeated layers (``scan_layers``) are static fields or change the tree's
structure, so those rewrites rebuild modules with :func:`replace_static`, visiting them with :func:`map_modules`.
"""

import dataclasses
from collections.abc import Callable

import equinox as eqx


def replace_static(module: eqx.Module, **changes):
    """A copy of ``module`` with some fields (static ones included) changed."""
    new = object.__new__(type(module))
    for f in dataclasses.fields(module):
        object.__setattr__(new, f.name, changes.pop(f.name, getattr(module, f.name)))
    if changes:
        raise TypeError(f"{type(module).__name__} has no field(s) {sorted(changes)}")
    return new


def has_field(module, name: str) -> bool:
    """Whether ``module`` is an ``eqx.Module`` with a field called ``name``."""
    return isinstance(module, eqx.Module) and any(f.name == name for f in dataclasses.fields(module))


def map_modules(fn: Callable, tree, *, fields: Callable | None = None):
    """``tree`` rebuilt bottom-up with every ``eqx.Module`` in it replaced by ``fn(module)``.

    Lists and tuples are rebuilt with their type; other leaves are kept. ``fields(module, name, value)``, if given,
    may rewrite one non-static field's (already rebuilt) value before ``fn`` sees the module: ``scan_layers`` uses
    it to stack or unstack the fields a class lists in ``SCAN_FIELDS``.
    """

    def rebuild(node):
        if isinstance(node, (list, tuple)):
            return type(node)(rebuild(x) for x in node)
        if not isinstance(node, eqx.Module):
            return node
        changes = {}
        for f in dataclasses.fields(node):
            if f.metadata.get("static", False):
                continue
            value = rebuild(getattr(node, f.name))
            changes[f.name] = value if fields is None else fields(node, f.name, value)
        return fn(replace_static(node, **changes))

    return rebuild(tree)


def module_classes(tree) -> list[type]:
    """The classes of every module in ``tree``, each once, in the order the walk meets them."""
    seen: dict[type, None] = {}

    def visit(m):
        seen.setdefault(type(m))
        return m

    map_modules(visit, tree)
    return list(seen)
