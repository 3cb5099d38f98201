"""Parameter paths as tuples of key names, for rules that pick leaves by name.

Example:
    >>> tx = optax.adamw(1e-3, weight_decay=0.1, mask=decay_mask)   # norms and biases keep their values
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


def decays(path: tuple[str, ...]) -> bool:
    """Whether weight decay applies to the leaf at `path`: not to normalization scales (a key that
    contains "norm") or biases (a key "bias"), as Hugging Face's Trainer and Megatron leave them."""
    return not any("norm" in k.lower() or k == "bias" for k in path)


def decay_mask(params):
    """A tree of booleans like `params`: True where weight decay applies (`decays`); pass it as an
    optax optimizer's `mask`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: decays(tuple(key_name(k) for k in path)), params)
