"""`jmem serve`: an OpenAI-compatible server for one model.

Example:
    $ jmem serve --model smollm2-135m --port 8000 --kv-cache-dtype fp8_e4m3
    $ python -m jmem.serve --model tiny --port 8001
    $ jmem serve --model smollm2-135m --lora-modules sql=sql.npz chat=chat.npz --max-lora-rank 16
    $ jmem serve --model smollm2-135m --tensor-parallel-size 3      # 9 q heads, 3 kv heads: 3 devices
    $ jmem serve --model smollm2-135m --num-speculative-tokens 4 --speculative-model draft.gguf
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
from typing import NoReturn

import tyro

from jmem.checks import check_int
from jmem.serve import DEFAULT_MAX_REQUEST_BYTES

log = logging.getLogger("jmem.serve")


@dataclasses.dataclass(frozen=True)
class ServeArgs:
    """Serve a model over HTTP with the OpenAI API."""

    model: str = "smollm2-135m"
    """The packaged smollm2-135m, a random-init preset (tiny, ...), a .gguf path or a model directory written by
    `jmem quantize --out DIR` or `experiments/train.py --save DIR`."""
    host: str = "127.0.0.1"
    """Interface to bind (127.0.0.1: this machine only)."""
    port: int = 8000
    """TCP port."""
    max_num_seqs: int = 32
    """Most requests running at once."""
    max_num_batched_tokens: int = 256
    """Most tokens computed per engine step (decodes + prefill chunks)."""
    max_model_len: int | None = None
    """Longest prompt + output; the model's context when unset."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_dtype: str = "auto"
    """KV storage: auto (compute dtype), bf16, fp8_e4m3, int8."""
    memory_utilization: float | None = None
    """Fraction of accelerator memory for weights + KV cache (0.9 when unset on GPU/TPU)."""
    kv_cache_memory: int | None = None
    """KV-cache budget in bytes (wins over --memory-utilization)."""
    num_blocks: int | None = None
    """Exact number of KV blocks (wins over both budgets; for tests)."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` on /v1 routes."""
    allowed_origins: tuple[str, ...] = ()
    """Origins whose browser pages may call the server (CORS), e.g. http://localhost:3000, or * for any;
    none when unset."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request body; a larger one is answered 413 before it is parsed."""
    shutdown_timeout: int = 30
    """Seconds SIGTERM/Ctrl-C waits for running requests to finish before it ends them and exits (a step
    shape compiling in the background then finishes first)."""
    param_dtype: str | None = None
    """Dtype of unquantized parameters (unset: a quantized directory's own, else f32)."""
    packed: bool = False
    """Keep a GGUF file's block-quantized matrices packed (decoded inside the step) instead of float."""
    init_seed: int = 0
    """Seed of a random-init preset's weights (the --seed of the train.py run that trained the adapters served
    on it); 0 for any other model."""
    compute_dtype: str | None = None
    """Dtype of activations (unset: a quantized directory's own, else f32)."""
    enable_prefix_caching: bool = True
    """Reuse cached KV blocks of shared prompt prefixes."""
    attention_impl: str = "auto"
    """Paged attention: auto (Pallas kernel on GPU/TPU, plain jnp on CPU), tiled, kernel."""
    warmup: bool = True
    """Compile the largest step shapes before listening; smaller ones then compile in the background."""
    log_level: str = "info"
    """uvicorn / jmem log level: critical, error, warning, info, debug, trace."""
    lora_modules: tyro.conf.UseAppendAction[tuple[tuple[str, ...], ...]] = ()
    """LoRA adapters served beside the base model, as NAME=PATH or vLLM's '{"name": NAME, "path": PATH}'
    (files written by jmem.lora.save_adapters, or PEFT LoRA directories); a request's `model` field picks
    one by NAME. The flag may be repeated: every occurrence's entries are served."""
    max_loras: int | None = None
    """Adapter slots on the device, the most adapters one step runs (one per --lora-modules entry when unset).
    Fewer slots than entries: the other adapters wait in host memory and move into a slot when a request
    needs one (requests of an adapter that finds no free slot wait for one)."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted; slots are zero-padded to the largest rank loaded (to this rank with
    --allow-runtime-lora)."""
    allow_runtime_lora: bool = False
    """Load and unload adapters while serving: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
    POST /v1/unload_lora_adapter {"lora_name"}, as vLLM. The --max-loras slots (one when unset and no
    --lora-modules) then hold every target weight at --max-lora-rank (the linears, and an MoE model's
    experts). The paths are read on this machine: allow it only where clients may read its files (and set
    --api-key)."""
    lora_impl: str = "onehot"
    """Batched adapter matmul: onehot (two dense matmuls) or ragged (jax.lax.ragged_dot on slot-sorted tokens)."""
    tensor_parallel_size: int = 1
    """Local devices to split the model over (Megatron tensor parallelism; the KV cache splits on its kv heads,
    so --kv-cache-memory is per device and the cache holds this many times the tokens)."""
    num_speculative_tokens: int = 0
    """Speculative decoding: tokens proposed per decode, verified in the same step (0: off); outputs keep the
    distribution of decoding without it. Proposed by the draft model when one is given, else by n-gram
    (prompt-lookup) matches in the sequence's own earlier tokens."""
    speculative_model: str | None = None
    """Draft model proposing --num-speculative-tokens tokens per decode, greedily: a preset, .gguf path or model
    directory with the model's vocabulary (its weights and KV cache count against the memory budget)."""
    speculative_layers: tuple[int, ...] = ()
    """Draft made of a copy of these layers of the model (self-speculative layer dropping), instead of
    --speculative-model."""
    prompt_lookup_max: int = 3
    """Longest suffix of a sequence looked up for a proposal (shorter ones down to 1 are tried next)."""


LOG_LEVELS = {"critical": 50, "error": 40, "warning": 30, "info": 20, "debug": 10, "trace": 5}  # uvicorn's


def check_args(args: ServeArgs) -> None:
    """ValueError naming the first bad flag; cheap checks only (nothing is loaded)."""
    from jmem.lm import check_packed, check_seed, model_source
    from jmem.models.config import as_dtype
    from jmem.serve.paged_cache import ATTENTION_IMPLS, KV_DTYPES

    if args.log_level.lower() not in LOG_LEVELS:
        raise ValueError(f"--log-level={args.log_level!r}; accepted: {', '.join(LOG_LEVELS)}")
    kind = model_source(args.model, "--model")[0]  # a missing file or package: one error naming the flag
    check_packed(args.packed, kind, args.model, "--packed")
    check_seed(args.init_seed, kind, args.model, "--init-seed")
    for flag, value in (("--param-dtype", args.param_dtype), ("--compute-dtype", args.compute_dtype)):
        if value is None:
            continue
        try:
            as_dtype(value)
        except ValueError as e:
            raise ValueError(f"{flag}={value!r}: {e}") from None
    if args.kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype={args.kv_cache_dtype!r}; accepted: {', '.join(KV_DTYPES)}")
    if args.attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"--attention-impl={args.attention_impl!r}; accepted: {', '.join(ATTENTION_IMPLS)}")
    for flag, value in (("--block-size", args.block_size), ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value < 1:
            raise ValueError(f"{flag}={value}; accepted: an integer >= 1")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len={args.max_model_len}; accepted: >= 1 (or unset for the model's context)")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port={args.port}; accepted: 1..65535")
    for flag, v, least in (("--max-request-bytes", args.max_request_bytes, 1),
                           ("--shutdown-timeout", args.shutdown_timeout, 0)):
        check_int(flag, v, least)
    for flag, v, ok, accepted in (("--num-blocks", args.num_blocks, lambda v: v >= 1, "an integer >= 1"),
                                  ("--kv-cache-memory", args.kv_cache_memory, lambda v: v > 0, "a number of bytes > 0"),
                                  ("--memory-utilization", args.memory_utilization, lambda v: 0 < v <= 1,
                                   "a fraction in (0, 1]")):
        if v is not None and not ok(v):  # before the model loads (the engine would say it after)
            raise ValueError(f"{flag}={v}; accepted: {accepted}, or unset")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(f"--api-key={args.api_key!r} would leave the server open (an unset variable in "
                         "--api-key \"$KEY\"?); accepted: a non-empty key, or no --api-key for an open server")
    from jmem.serve.api import check_origins
    from jmem.serve.ngram import check_speculative_args

    check_origins(args.allowed_origins)

    check_speculative_args(args.num_speculative_tokens, args.prompt_lookup_max, flags=True,
                           draft_model=args.speculative_model, draft_layers=args.speculative_layers)
    if args.speculative_model is not None:
        from jmem.experiment import check_draft_vocabulary

        check_draft_vocabulary(args.model, args.speculative_model, "--speculative-model")
    lora_modules(args)  # each adapter file read and its rank checked
    check_tensor_parallel_args(args)


def check_tensor_parallel_args(args: ServeArgs) -> None:
    """`--tensor-parallel-size` against the local devices and the head counts of a preset `--model` or
    `--speculative-model` (a model file's heads, and how its quantized weights split, are checked once
    it loads)."""
    from jmem.lm import model_source
    from jmem.models.config import get_config
    from jmem.serve.tensor_parallel import check_tensor_parallel

    tp = args.tensor_parallel_size
    try:
        if tp < 1:
            raise ValueError("accepted: an integer >= 1")
        import jax

        n = jax.local_device_count()
        if tp > n:
            raise ValueError(f"exceeds the {n} local {jax.default_backend()} devices; accepted: 1..{n}")
        for flag, name in (("--model", args.model), ("--speculative-model", args.speculative_model)):
            if name is not None and model_source(name, flag)[0] == "preset":
                try:
                    check_tensor_parallel(get_config(name), tp)
                except ValueError as e:
                    detail = str(e).removeprefix(f"tensor_parallel_size={tp}: ")
                    raise ValueError(detail if flag == "--model" else f"with {flag} {name}: {detail}") from None
    except ValueError as e:
        msg = str(e).removeprefix(f"tensor_parallel_size={tp}: ")
        raise ValueError(f"--tensor-parallel-size={tp}: {msg}") from None


def _lora_module(item: str) -> tuple[str, str]:
    """(name, path) of one `--lora-modules` entry: NAME=PATH, or vLLM's JSON form
    `{"name": NAME, "path": PATH}` (its optional "base_model_name" is not checked: files carry no model name)."""
    accepted = 'NAME=PATH or {"name": NAME, "path": PATH}'
    if item.lstrip().startswith("{"):
        try:
            entry = json.loads(item)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules entry {item!r} is not valid JSON ({e}); accepted: {accepted}") from None
        name, path = entry.get("name"), entry.get("path")
        unknown = set(entry) - {"name", "path", "base_model_name"}
        if not isinstance(name, str) or not isinstance(path, str) or unknown:
            raise ValueError(f"--lora-modules entry {item!r}; accepted: {accepted}")
    else:
        name, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules entry {item!r}; accepted: {accepted}")
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"--lora-modules entry {item!r}; accepted: {accepted}")
    return name, path


def lora_modules(args: ServeArgs) -> dict[str, str]:
    """`--lora-modules` as {name: path}, each file read and its rank checked (the model is not loaded)."""
    from jmem.serve.lora import IMPLS, check_adapter_files

    if args.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank={args.max_lora_rank}; accepted: >= 1")
    if args.lora_impl not in IMPLS:
        raise ValueError(f"--lora-impl={args.lora_impl!r}; accepted: {', '.join(IMPLS)}")
    modules: dict[str, str] = {}
    groups = args.lora_modules  # one tuple per --lora-modules occurrence (a flat tuple from Python is taken too)
    for item in (e for g in groups for e in ((g,) if isinstance(g, str) else g)):
        name, path = _lora_module(item)
        if name == args.model:
            raise ValueError(f"--lora-modules name {name!r} is the base model's name; accepted: another name")
        if name in modules:
            raise ValueError(f"--lora-modules name {name!r} is given twice; accepted: distinct names")
        modules[name] = path
    if args.max_loras is not None and args.max_loras < 1:
        raise ValueError(f"--max-loras={args.max_loras}; accepted: an integer >= 1")
    try:
        check_adapter_files(modules, args.max_lora_rank)
    except ValueError as e:  # the file's own message, named by the flag it came from as the others are
        raise ValueError(f"--lora-modules: {e}") from None
    return modules


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening; uvicorn listens on it).

    Binding before the model loads turns a port in use or a bad host into one clear error
    in a second, not after minutes of loading.
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _check_max_model_len(args: ServeArgs, context: int) -> None:
    if args.max_model_len is not None and args.max_model_len > context:
        raise ValueError(f"--max-model-len={args.max_model_len} exceeds the context length of model "
                         f"{args.model!r} ({context} tokens); accepted: 1..{context}")


def build_engine(args: ServeArgs):
    """Load the model and build the engine described by `args`; returns (engine, model name)."""
    import jmem
    from jmem.lm import model_source
    from jmem.models.config import get_config
    from jmem.serve.draft import load_draft
    from jmem.serve.engine import Engine, EngineConfig

    check_args(args)
    if model_source(args.model, "--model")[0] == "preset":  # known now; a model file's context is read as it loads
        _check_max_model_len(args, get_config(args.model).max_seq_len)
    lm = jmem.load(args.model, param_dtype=args.param_dtype, compute_dtype=args.compute_dtype, packed=args.packed,
                   seed=args.init_seed)
    _check_max_model_len(args, lm.config.max_seq_len)
    cfg = EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                       kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
                       memory_utilization=args.memory_utilization, num_blocks=args.num_blocks,
                       enable_prefix_caching=args.enable_prefix_caching, attention_impl=args.attention_impl,
                       max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, lora_impl=args.lora_impl,
                       allow_runtime_lora=args.allow_runtime_lora, tensor_parallel_size=args.tensor_parallel_size,
                       num_speculative_tokens=args.num_speculative_tokens, prompt_lookup_max=args.prompt_lookup_max)
    draft_packed = args.packed and args.speculative_model is not None \
        and model_source(args.speculative_model, "--speculative-model")[0] == "gguf"  # where it applies
    draft = load_draft(lm.model, args.speculative_model, args.speculative_layers, tokenizer=lm.tokenizer,
                       param_dtype=args.param_dtype, compute_dtype=args.compute_dtype, packed=draft_packed)
    return Engine(lm.model, lm.tokenizer, cfg, lora_modules=lora_modules(args), draft_model=draft), args.model


def _fail(message: str) -> NoReturn:
    print(f"jmem serve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def serve_main(argv: list[str] | None = None) -> None:
    """`python -m jmem.serve`: `jmem serve` with these flags (its exit statuses: `| head`, Ctrl-C)."""
    from jmem.cli import main

    main(["serve", *(sys.argv[1:] if argv is None else argv)])


def _graceful_server(config, engine, shutdown_timeout: int):
    """A uvicorn server whose shutdown (SIGTERM, Ctrl-C) lets running requests finish for
    `shutdown_timeout` seconds, then aborts them: each ends as `finish_reason` "abort", its
    response complete (no cancelled task, no 500). A connection that never reaches the engine (a
    client that stalls mid-body) is closed by uvicorn a few seconds after that, so shutdown ends."""
    import uvicorn

    config.timeout_graceful_shutdown = shutdown_timeout + 5  # the aborted responses get 5 s to finish
    logging.getLogger("uvicorn.error").addFilter(_not_cancelled)  # once: the same filter object

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                timer = threading.Timer(shutdown_timeout, engine.abort_all)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    return Server(config)


def _not_cancelled(record: logging.LogRecord) -> bool:
    """Log filter: a task uvicorn cancels at the end of a graceful shutdown (a stalled connection's)
    is no server error."""
    import asyncio

    return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def _exit_on_signal(signum: int, frame) -> NoReturn:
    """SIGTERM (exit 0) or Ctrl-C (130) while loading or compiling, or once uvicorn has shut down
    gracefully and raises the signal again: exit now. Not KeyboardInterrupt: Python drops an exception
    raised where it is ignored (a garbage-collection callback of XLA's, a `__del__`) and the process
    would go on serving; nor the interpreter's teardown, which can race XLA threads still compiling
    (a segmentation fault instead of the exit status)."""
    try:
        if signum == signal.SIGINT:
            print("jmem: interrupted", file=sys.stderr)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:  # a flush interrupted mid-write may raise: exit all the same
        os._exit(130 if signum == signal.SIGINT else 0)


def run_serve(args: ServeArgs) -> None:
    """`jmem serve`: check the flags, bind, load, log capacity and address, serve until interrupted."""
    try:
        check_args(args)
    except ValueError as e:
        _fail(str(e))
    level = args.log_level.lower()
    logging.basicConfig(level=LOG_LEVELS[level], format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # While serving, uvicorn holds these signals, shuts down gracefully, then raises them again for this handler.
    handlers = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _serve(args, *_load(args))
    finally:  # a failure to load or serve, called in-process: the caller's handlers are back
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _load(args: ServeArgs):
    """Bind, build the engine, log its sizes, compile its step buckets (--warmup)."""
    sock = None
    try:
        sock = bind_socket(args.host, args.port)
        engine, name = build_engine(args)
    except (ValueError, FileNotFoundError) as e:
        if sock is not None:
            sock.close()
        _fail(str(e))
    m = engine.metrics()
    log.info("weights: %.1f MiB per device", engine.weight_bytes / 2**20)
    log.info("KV cache: %d blocks x %d tokens = %d tokens (%s), max context %d",
             m["kv_cache_blocks"], engine.kv.block_size, m["kv_cache_capacity_tokens"],
             args.kv_cache_dtype, engine.max_request_tokens)
    if engine.adapters or args.allow_runtime_lora:
        from jmem.serve.lora import slot_layout

        slot = max(rank for _, _, rank in slot_layout(engine.runner.state).values())
        slots = engine.runner.adapter_slots.num_slots
        log.info("LoRA adapters: %s in %d device slots of rank %d, %.1f KiB on the device%s%s",
                 ", ".join(f"{n} (rank {a.rank})" for n, a in engine.adapters.items()) or "none yet", slots, slot,
                 engine.adapter_bytes / 1024,
                 "" if slots >= len(engine.adapters) else "; the others wait in host memory until a request uses them",
                 "; more load while serving (POST /v1/load_lora_adapter)" if args.allow_runtime_lora else "")
    if engine.drafter is not None:
        draft = engine.drafter.runner.config
        log.info("speculative decoding: a %d-layer draft proposes %d tokens per decode", draft.n_layers,
                 args.num_speculative_tokens)
    if args.warmup:
        engine.precompile()
    return engine, name, sock


def _serve(args: ServeArgs, engine, name: str, sock) -> None:
    """Start the engine and serve on `sock` until SIGTERM (exit 0) or Ctrl-C (130)."""
    import uvicorn

    from jmem.serve.api import create_app

    level = args.log_level.lower()
    engine.start()
    try:  # from here on the engine's thread runs: every way out stops it (uvicorn's startup failure, an error)
        app = create_app(engine, name, args.api_key, max_request_bytes=args.max_request_bytes,
                         allowed_origins=args.allowed_origins)
        server = _graceful_server(uvicorn.Config(app, host=args.host, port=args.port, log_level=level), engine,
                                  args.shutdown_timeout)
        host = f"[{args.host}]" if ":" in args.host else args.host
        log.info("jmem serve: model %s listening on http://%s:%d (KV cache holds %d tokens)",
                 name, host, sock.getsockname()[1], engine.num_kv_tokens)
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
