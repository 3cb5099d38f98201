"""Pytree key paths as names, for rules that pick leaves by name (optimizer layouts, sharding, decay).

Example:
    >>> leaf_paths({"layers": {"wq": {"kernel": w}}})[0]
    [(('layers', 'wq', 'kernel'), w)]
"""

from __future__ import annotations

import jax


def key_name(k) -> str:
    """The name of one pytree path key (a dict key, an attribute name or a sequence index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_paths(tree) -> tuple[list[tuple[tuple[str, ...], object]], object]:
    """`([(path names, leaf), ...], treedef)` of `tree`'s leaves, in flattening order."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(key_name(k) for k in path), x) for path, x in with_path], treedef
