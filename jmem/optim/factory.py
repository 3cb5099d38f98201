"""`make_optimizer(name, lr, **kw)`: one name per optimizer, for flags and configs."""

from __future__ import annotations

import inspect

import jax
import optax

from jmem.optim import checks
from jmem.optim.adafactor import adafactor
from jmem.optim.adam8bit import adam8bit
from jmem.optim.galore import galore
from jmem.pytree import key_name

OPTIMIZERS = {
    "adamw": optax.adamw,
    "adafactor": adafactor,
    "adam8bit": adam8bit,
    "galore": galore,
    "sgd": optax.sgd,
}


# optax's own constructors check nothing: a b2 of 2 or a negative eps silently trains wrong.
_OPTAX_CHECKS = {
    "adamw": {"b1": checks.decay, "b2": checks.decay, "eps": checks.non_negative, "eps_root": checks.non_negative,
              "weight_decay": checks.rate,
              "mu_dtype": lambda who, name, v: checks.float_dtype(who, name, v, none_ok=True)},
    "sgd": {"momentum": lambda who, name, v: checks.decay(who, name, v, none_ok=True), "nesterov": checks.flag},
}


def decays(path: tuple[str, ...]) -> bool:
    """Whether weight decay applies to the leaf at `path` (key names): not to normalization scales (a key
    that contains "norm") or biases (a key "bias"), as Hugging Face's Trainer and Megatron leave them."""
    return not any("norm" in k.lower() or k == "bias" for k in path)


def decay_mask(params):
    """A tree of booleans like `params`: True where weight decay applies (`decays`); pass it as an
    optax optimizer's `mask`, e.g. `optax.adamw(1e-3, weight_decay=0.1, mask=decay_mask)`."""
    return jax.tree_util.tree_map_with_path(lambda path, _: decays(tuple(key_name(k) for k in path)), params)


class UnknownOptimizerError(ValueError):
    """An optimizer name that `make_optimizer` does not know."""


def make_optimizer(name: str, lr: "float | optax.Schedule", **kw) -> optax.GradientTransformation:
    """Builds an optimizer by name.

    Args:
        name: one of "adamw", "adafactor", "adam8bit", "galore", "sgd" (case-insensitive).
        lr: learning rate, a finite number >= 0 or an optax schedule; None only for
            "adafactor" (its relative step size).
        **kw: passed to the constructor (`optax.adamw`, `jmem.optim.adafactor`,
            `jmem.optim.adam8bit`, `jmem.optim.galore`, `optax.sgd`); unknown keywords are an error.

    Raises:
        UnknownOptimizerError: unknown name (the message lists valid names).
        ValueError: a keyword the chosen optimizer does not accept, a bad `lr` (None for
            another optimizer than adafactor: optax would take it as 1 and climb the gradient), or
            a value out of range (adamw's b1, b2 in [0, 1), eps, eps_root, weight_decay >= 0;
            sgd's momentum in [0, 1), its nesterov a bool).

    Example:
        >>> tx = make_optimizer("adafactor", 1e-2, momentum=0.9)
    """
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in OPTIMIZERS:
        raise UnknownOptimizerError(f"optimizer {name!r}; accepted: {', '.join(OPTIMIZERS)}")
    checks.learning_rate(key, lr, none_ok=key == "adafactor")
    ctor = OPTIMIZERS[key]
    params = inspect.signature(ctor).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        bad = sorted(set(kw) - set(params) | set(kw) & {"learning_rate"})
        if bad:
            accepted = ", ".join(p for p in params if p != "learning_rate")
            raise ValueError(f"optimizer {key!r} does not accept {', '.join(bad)}; accepted: {accepted}")
    for arg, check in _OPTAX_CHECKS.get(key, {}).items():
        if arg in kw:
            check(key, arg, kw[arg])
    return ctor(lr, **kw)
