"""The command line of the experiment scripts: typed flags from a dataclass (tyro), and bad input
with exit status 2, never a traceback: a value the checks refuse as one `error: ...` line on
stderr, a flag tyro cannot parse (unknown, or of the wrong type) with tyro's own message, which
names the flag and shows its help line.

Example:
    >>> def cli(argv=None) -> int:
    ...     return run_experiment(Config, main, argv, description=__doc__)
"""

from __future__ import annotations

import sys
from typing import Callable

from jmem.io.paths import forget_created_dirs, quiet_closed_stdout, remove_unused_dirs


def run_experiment(config_cls: type, main: Callable, argv: list[str] | None = None,
                   description: str | None = None) -> int:
    """Parse `argv` into `config_cls`, run `main(config)`; returns the exit status.

    A `ValueError` (bad input) is status 2 with one `error:` line, an `OSError` (a missing model package,
    an output that cannot be written) status 1 with one line; Ctrl-C is 130 with one line (results written
    so far stay); a reader of stdout that goes away (`| head`) ends the run quietly with 141, as SIGPIPE
    would.
    `description`: the script's docstring (its first paragraph becomes the `--help` summary).
    """
    import tyro  # here: `exit_status` serves scripts that run where tyro is not installed

    summary = description.split("\n\n")[0] if description else None
    cfg = tyro.cli(config_cls, args=argv, description=summary)
    try:
        main(cfg)
    except BaseException as e:
        remove_unused_dirs()  # output directories made for a run that failed before writing into them
        return exit_status(e)
    forget_created_dirs()
    return 0


def exit_status(e: BaseException) -> int:
    """The exit status of a script that raised `e`, after its one line on stderr; other errors re-raised."""
    if isinstance(e, BrokenPipeError):
        quiet_closed_stdout()
        return 141
    if isinstance(e, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return 130
    if isinstance(e, (ValueError, OSError)):
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    raise e


def model_config(model: str, flag: str = "--model"):
    """The `LlamaConfig` of `model` without loading its weights (a preset's, or read from a GGUF file's
    header or a quantized model directory's manifest); a ValueError naming `flag` for a missing one."""
    from jmem.io.gguf import config_from_gguf, read_gguf
    from jmem.lm import model_source
    from jmem.models.config import get_config
    from jmem.quant.saved import config_from_manifest, read_manifest

    kind, path = model_source(model, flag)
    if kind == "preset":
        return get_config(path)
    return config_from_gguf(read_gguf(path)) if kind == "gguf" else config_from_manifest(read_manifest(path))


def check_draft_vocabulary(model: str, draft: str, draft_flag: str) -> None:
    """A ValueError naming `draft_flag` when the draft's vocabulary size is not `--model`'s, read from their
    headers (presets, GGUF files, model directories) before either model loads."""
    vocab, draft_vocab = model_config(model).vocab_size, model_config(draft, draft_flag).vocab_size
    if vocab != draft_vocab:
        raise ValueError(f"{draft_flag} {draft!r} has a vocabulary of {draft_vocab} tokens, --model {model!r} one of "
                         f"{vocab}; accepted: a draft with the model's tokenizer")


def check_dense(model: str, what: str, flag: str = "--model") -> None:
    """A ValueError naming `flag` when `model` is a mixture-of-experts model, which `what` does not handle."""
    config = model_config(model, flag)
    if config.moe_experts:
        raise ValueError(f"{flag} {model!r} is a mixture-of-experts model ({config.moe_experts} experts); {what} "
                         "reads dense MLP weights; accepted: a dense model")


def check_flags_read(cfg, methods: list[str], readers: dict[str, tuple]) -> None:
    """Refuse a flag of `cfg` (a dataclass) set away from its default that none of `methods` reads.

    `readers`: flag -> (field, whether a method reads it, the methods that do in words, and any values
    that also mean "none", e.g. 0 windows); a boolean field is named by the flag that sets it (e.g.
    `--no-act-order`).
    """
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for flag, (field, reads, who, *unset) in readers.items():
        value = getattr(cfg, field)
        if value != defaults[field] and value not in unset and not any(map(reads, methods)):
            shown = flag if isinstance(value, bool) else f"{flag} {value}"
            raise ValueError(f"{shown} is read by none of --methods {','.join(methods)}; accepted: {flag} with "
                             f"{who}")


def check_windows_fit(n_tokens: int, windows: int, n_calib: int, calib_flag: str, window: int) -> None:
    """A ValueError naming --windows (and `calib_flag` when it asks for windows) and the largest accepted count
    when the text's `n_tokens` hold fewer than `windows + n_calib` windows of `window` tokens (the
    evaluation scripts' --windows and their calibration flag)."""
    need = (windows + n_calib) * window
    if n_tokens >= need:
        return
    total = n_tokens // window
    flags = f"--windows={windows}" + (f" with {calib_flag}={n_calib}" if n_calib else "")
    if total <= n_calib:
        accepted = f"a --text of at least {(1 + n_calib) * window} tokens" + (f", or a smaller {calib_flag}"
                                                                             if total else "")
    elif n_calib:
        accepted = f"--windows <= {total - n_calib} (--windows + {calib_flag} <= {total}), or a longer --text"
    else:
        accepted = f"--windows <= {total}, or a longer --text"
    raise ValueError(f"{flags}: {windows} evaluation + {n_calib} calibration windows of {window} tokens need {need} "
                     f"tokens and the text has {n_tokens}; accepted: {accepted}")
