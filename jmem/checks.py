"""Argument checks shared across the package: an integer is a Python or NumPy integer, never a bool
(and never a float that happens to be whole); a number is an integer or a float, never a bool; a bad
one is one ValueError naming it.

Example:
    >>> check_int("batch_size", 8, 1)
    >>> is_int(True), is_int(np.int64(3))
    (False, True)
"""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_seed(name: str, value) -> None:
    """ValueError `name=value; accepted: ...` unless `value` is an integer seed in [-2**63, 2**64)
    (64 bits, signed or not: every bit keys the draws, see `jmem.sampling.seed_key`)."""
    if not is_int(value) or not -(2**63) <= value < 2**64:
        raise ValueError(f"{name}={value!r}; accepted: an integer in [-2**63, 2**64)")


def check_arrays(name: str, **arrays) -> None:
    """ValueError `name: arg is a list; accepted: an array` (`name: arg=None; ...` for None) unless every
    given value has a shape (a NumPy or JAX array, a tracer or a ShapeDtypeStruct); pass required arrays only."""
    for arg, x in arrays.items():
        if not hasattr(x, "shape"):
            shown = f"{arg}=None" if x is None else f"{arg} is a {type(x).__name__}"
            raise ValueError(f"{name}: {shown}; accepted: an array")


def check_bool(name: str, value) -> None:
    """ValueError `name=value; accepted: True or False` unless `value` is a Python or NumPy bool
    (a string such as "no" would otherwise count as true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r}; accepted: True or False")


def check_optimizer(tx, name: str = "optimizer") -> None:
    """ValueError unless `tx` is an optax transformation (an object with `init` and `update`)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise ValueError(f"{name}={tx!r:.80}; accepted: an optax.GradientTransformation, e.g. optax.adamw(1e-3) or "
                         "jmem.optim.make_optimizer('adafactor', 1e-3)")


def check_targets(targets, names) -> tuple:
    """`targets` (a name, or a list or tuple of names) as a tuple: non-empty, each among `names`, none twice;
    else one ValueError naming the value and the accepted names."""
    accepted = f"names among {', '.join(names)}"
    if not isinstance(targets, (str, list, tuple)):
        raise ValueError(f"targets={targets!r}; accepted: a name or a list of {accepted}")
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets:
        raise ValueError(f"targets is empty; accepted: {accepted}")
    for i, name in enumerate(targets):
        if name not in names:
            raise ValueError(f"unknown target {name!r}; accepted: {accepted}")
        if name in targets[:i]:
            raise ValueError(f"target {name!r} is listed twice in targets={targets}; accepted: distinct {accepted}")
    return targets


def is_number(value) -> bool:
    """A Python or NumPy integer or float, not a bool (finiteness is the caller's to check)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def as_python_scalar(value):
    """A 0-d NumPy or concrete JAX array of a number dtype (`jnp.float32(0.7)`) as its Python number;
    anything else (a bool array, a tracer, a list) unchanged, for the checks above to judge."""
    dtype = getattr(value, "dtype", None)
    if getattr(value, "shape", None) != () or dtype is None or np.dtype(dtype).kind not in "iuf":
        return value
    try:
        return value.item()
    except Exception:  # noqa: BLE001 - a tracer has no value
        return value


def check_int(name: str, value, least: int) -> None:
    """ValueError `name=value; accepted: an integer >= least` unless `value` is such an integer."""
    if not is_int(value) or value < least:
        raise ValueError(f"{name}={value!r}; accepted: an integer >= {least}")


def check_llama(name: str, model) -> None:
    """ValueError naming `name` unless `model` is a jmem Llama (a module with a `LlamaConfig`; a `jmem.LM`
    has one too but is not the module: its `.model` is)."""
    from flax import nnx

    from jmem.models.config import LlamaConfig

    if not isinstance(model, nnx.Module) or not isinstance(getattr(model, "config", None), LlamaConfig):
        shown = repr(model)
        shown = f"={shown}" if len(shown) <= 60 and "\n" not in shown else f" is a {type(model).__name__}"
        raise ValueError(f"{name}{shown}; accepted: a jmem.models.Llama model")


def loss_pair(out, name: str = "loss_fn"):
    """`out` of a training loss function as (loss summed over the batch, count); one ValueError naming
    what came back otherwise (a mean alone, or a longer tuple)."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        got = (f"a {len(out)}-tuple" if isinstance(out, (tuple, list)) else
               f"one array of shape {tuple(out.shape)}" if hasattr(out, "shape") else f"a {type(out).__name__}")
        raise ValueError(f"{name} returned {got}; accepted: a pair (loss summed over the batch's "
                         "tokens, their count), e.g. `return jnp.sum(nll * mask), jnp.sum(mask)`")
    for what, x in zip(("loss sum", "count"), out):
        if np.ndim(x) != 0:
            raise ValueError(f"{name} returned a {what} of shape {tuple(np.shape(x))}; accepted: a pair of scalars "
                             "(loss summed over the batch's tokens, their count)")
    return out


def stop_strings(stop) -> list[str]:
    """`stop` as a list of stop strings: None is none and one string is one stop string (as OpenAI's
    `stop`), not its characters; ValueError unless each is a non-empty string (an empty one would
    end every output before its first token)."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop={stop!r}; accepted: a non-empty string or a list of them")
    return list(stops)


def cut_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to the first of `stops` it holds (whole when it holds none)."""
    return min((text[: text.find(s)] for s in stops if s in text), key=len, default=text)
