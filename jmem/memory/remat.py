"""Named rematerialisation (activation checkpointing) policies.

A policy decides, for every intermediate of a layer's forward pass, whether the
backward pass finds it saved in device memory, offloaded to pinned host
memory, or recomputes it. Policies are strings so a command-line flag and a
Python call say the same thing:

=======================  ===========================================================
``none``                 no remat: every residual is kept (most memory, fewest FLOPs)
``full``                 save nothing inside a layer; recompute the whole layer
``dots``                 save every matmul output (``dots_saveable``)
``dots_no_batch``        save matmul outputs without batch dims (weights-only dots)
``minimal``              save the named projections: query/key/value, attn_out,
                         MLP gate/up (in) and mlp_out; recompute the rest
``save_dot_except_mlp``  save the attention projections, recompute the MLP
``offload``              the ``minimal`` names, offloaded to pinned host memory
custom spec              ``"query=device,mlp_up=offload"``: each listed name is
                         kept on device or offloaded; unlisted names are recomputed.
                         ``remat`` is accepted as an explicit third choice.
=======================  ===========================================================

Names come from the one table in `jmem.memory.names`; layers tag tensors with
``jax.ad_checkpoint.checkpoint_name(x, name)``.

Example:
    >>> from jmem.memory.remat import get_policy, remat
    >>> policy = get_policy("minimal")        # a jax checkpoint policy
    >>> layer = remat(layer_fn, "minimal")    # jax.checkpoint(layer_fn, policy=...)
"""

from __future__ import annotations

from typing import Callable

import jax

from jmem.memory.names import ACTIVATIONS

# The projections `minimal` keeps: the outputs of the weight matmuls whose
# recomputation would cost a full matmul each.
MINIMAL_NAMES: tuple[str, ...] = ("query", "key", "value", "attn_out", "mlp_gate", "mlp_up", "mlp_out")
# Attention-side matmul outputs; the MLP (the largest tensors) is recomputed.
ATTENTION_DOT_NAMES: tuple[str, ...] = ("query", "key", "value", "attention", "attn_out")

POLICIES: tuple[str, ...] = (
    "none",
    "full",
    "dots",
    "dots_no_batch",
    "minimal",
    "save_dot_except_mlp",
    "offload",
)
CHOICES: tuple[str, ...] = ("remat", "device", "offload")


def _save_and_offload(saved: tuple[str, ...], offloaded: tuple[str, ...]) -> Callable:
    if not offloaded:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved),
        names_which_can_be_offloaded=list(offloaded),
        offload_src="device",
        offload_dst="pinned_host",
    )


def parse_spec(spec: str) -> dict[str, str]:
    """Parse a custom spec ``"name=remat|device|offload,..."`` into a dict.

    Raises:
        ValueError: an unknown activation name, an unknown choice, or a bad item.
    """
    if not isinstance(spec, str):
        raise ValueError(f"remat spec {spec!r} ({type(spec).__name__}); accepted: a string 'name=choice,...'")
    out: dict[str, str] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(
                f"remat spec item {item!r} is not name=choice; named policies: {', '.join(POLICIES)}"
            )
        name, choice = (s.strip() for s in item.split("=", 1))
        if name not in ACTIVATIONS:
            raise ValueError(f"remat spec: unknown activation name {name!r}; accepted: {', '.join(ACTIVATIONS)}")
        if choice not in CHOICES:
            raise ValueError(f"remat spec: {name}={choice!r}; accepted: {', '.join(CHOICES)}")
        if name in out:
            raise ValueError(f"remat spec: name {name!r} given twice")
        out[name] = choice
    if not out:
        raise ValueError(f"remat spec {spec!r} is empty; named policies: {', '.join(POLICIES)}")
    return out


def get_policy(name: str | None) -> Callable | None:
    """The jax checkpoint policy for a policy string, or None for no remat.

    Args:
        name: one of `POLICIES`, or a custom spec such as
            ``"query=device,key=device,mlp_up=offload"``. ``None`` means
            ``"none"``; ``""`` is refused (a flag given empty says nothing).

    Returns:
        A callable usable as ``jax.checkpoint(fn, policy=...)``, or None when
        the layer should not be wrapped in ``jax.checkpoint`` at all.

    Raises:
        ValueError: the name is not a string, or neither a known policy nor a valid spec.

    Example:
        >>> get_policy("none") is None
        True
        >>> p = get_policy("query=device,mlp_up=offload")
    """
    if name is None or name == "none":
        return None
    if not isinstance(name, str):
        raise ValueError(
            f"remat policy {name!r} ({type(name).__name__}); accepted: None, one of {', '.join(POLICIES)}, "
            f"or a spec string 'name=remat|device|offload,...'"
        )
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots":
        return jax.checkpoint_policies.dots_saveable
    if name == "dots_no_batch":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name == "minimal":
        return jax.checkpoint_policies.save_only_these_names(*MINIMAL_NAMES)
    if name == "save_dot_except_mlp":
        return jax.checkpoint_policies.save_only_these_names(*ATTENTION_DOT_NAMES)
    if name == "offload":
        return _save_and_offload((), MINIMAL_NAMES)
    if "=" not in name:
        raise ValueError(
            f"unknown remat policy {name!r}; accepted: {', '.join(POLICIES)}, "
            f"or a spec 'name=remat|device|offload,...' over names {', '.join(ACTIVATIONS)}"
        )
    spec = parse_spec(name)
    saved = tuple(n for n, c in spec.items() if c == "device")
    offloaded = tuple(n for n, c in spec.items() if c == "offload")
    return _save_and_offload(saved, offloaded)


def validate(name: str | None) -> str:
    """Check a policy string early (before any compile); returns it unchanged."""
    get_policy(name)
    return "none" if name is None else name


def remat(fn: Callable, name: str | None, *, prevent_cse: bool = True, static_argnums: tuple[int, ...] = ()) -> Callable:
    """Wrap `fn` (one layer's forward) in ``jax.checkpoint`` with a named policy.

    ``"none"`` returns `fn` unchanged. Inside ``lax.scan`` the loop already
    blocks CSE, so callers that scan over layers may pass ``prevent_cse=False``.

    Example:
        >>> body = remat(block_fn, "minimal", prevent_cse=False)
        >>> h, _ = jax.lax.scan(body, h, stacked_params)
    """
    if not callable(fn):
        raise ValueError(f"remat: fn={fn!r} ({type(fn).__name__}); accepted: a callable (one layer's forward)")
    policy = get_policy(name)
    if policy is None:
        return fn
    return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums)
