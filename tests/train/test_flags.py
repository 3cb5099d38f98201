"""Flag checks of `experiments/train.py` before any work (`jmem.train.checks.validate`), the
optimizer chain (`make_tx`), the model-file header read, the jitted-step cache and the
memory table's matmul count. Nothing here compiles a train step."""

import dataclasses
import gc
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem.memory.precision import Policy
from jmem.train import TrainConfig
from jmem.train import loop
from jmem.train import report as report_mod
from jmem.train.checks import validate
from jmem.train.setup import make_tx
from jmem.train.step import TrainFns
from tests.helpers import run_train_script

F32 = Policy.parse("f32")


def _one_update(tx, params, grads):
    @jax.jit
    def update(params, grads):
        updates, _ = tx.update(grads, tx.init(params), params)
        return jax.tree.map(lambda p, u: p + u, params, updates)

    return update(params, grads)


@pytest.mark.parametrize("optimizer", ["adamw", "adam8bit", "galore"])
def test_weight_decay_zero_means_none_and_spares_norms(optimizer):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 64)) + 3.0, jnp.float32),  # 4096: adam8bit's 8-bit path
              "layers": {"attn_norm": {"scale": jnp.ones((2, 64))}}, "norm": {"scale": jnp.ones(64)}}
    zero = jax.tree.map(jnp.zeros_like, params)
    cfg = TrainConfig(optimizer=optimizer, lr=0.1, warmup=0, clip=1.0, weight_decay=0.0)
    same = _one_update(make_tx(cfg, F32), params, zero)
    jax.tree.map(np.testing.assert_array_equal, same, params)
    shrunk = _one_update(make_tx(dataclasses.replace(cfg, weight_decay=0.1), F32), params, zero)
    # Decoupled decay at the peak rate: p - lr * wd * p; normalization scales are not decayed.
    np.testing.assert_allclose(np.asarray(shrunk["w"]), np.asarray(params["w"]) * (1 - 0.1 * 0.1), rtol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, {k: shrunk[k] for k in ("layers", "norm")},
                 {k: params[k] for k in ("layers", "norm")})


def _sgd_rates(cfg: TrainConfig, n: int) -> list[float]:
    """Learning rate of each of the first n steps of `make_tx` (sgd on a unit gradient)."""
    tx = make_tx(cfg, F32)
    p, g = {"w": jnp.zeros(())}, {"w": jnp.ones(())}
    state, out = tx.init(p), []
    for _ in range(n):
        u, state = tx.update(g, state, p)
        out.append(-float(u["w"]))
    return out


def test_explicit_warmup_is_honoured_and_unset_scales_with_short_runs():
    rates = _sgd_rates(TrainConfig(optimizer="sgd", lr=1.0, steps=20, warmup=15, clip=0.0), 8)
    np.testing.assert_allclose(rates, [k / 15 for k in range(8)], rtol=1e-6)  # linear from 0 over 15 steps
    assert TrainConfig(steps=20).warmup_steps == 4 and TrainConfig(steps=200).warmup_steps == 20
    assert TrainConfig(steps=10_000).warmup_steps == 20 and TrainConfig(steps=20, warmup=0).warmup_steps == 0
    auto = _sgd_rates(TrainConfig(optimizer="sgd", lr=1.0, steps=20, clip=0.0), 5)
    np.testing.assert_allclose(auto[:5], [0, 0.25, 0.5, 0.75, 1.0], rtol=1e-6)


def _one_line_exit_2(argv, capsys) -> str:
    rc, err = run_train_script(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["--lr", "inf"], "--lr=inf must be a finite number > 0"),
    (["--lr", "nan"], "--lr=nan must be a finite number > 0"),
    (["--lr", "0"], "--lr=0.0 must be a finite number > 0"),
    (["--clip", "nan"], "--clip=nan must be a finite number >= 0"),
    (["--clip", "-1"], "--clip=-1.0 must be a finite number >= 0"),
    (["--weight-decay", "nan"], "--weight-decay=nan must be a finite number >= 0"),
    (["--weight-decay", "-1"], "--weight-decay=-1.0 must be a finite number >= 0"),
    (["--weight-decay", "inf", "--optimizer", "adamw"], "--weight-decay=inf must be a finite number >= 0"),
    (["--weight-decay", "0.1", "--optimizer", "sgd"], "--weight-decay=0.1 is not applied by --optimizer sgd"),
    (["--warmup", "30", "--steps", "20"], "--warmup=30 must be in 0..--steps=20"),
    (["--warmup", "-1"], "--warmup=-1 must be in 0..--steps=200"),
    (["--mesh", "stage=2,data=4"], "has a stage axis but --pipeline-stages is 1"),
    (["--mesh", "data=4,tensor=2", "--pipeline-stages", "2"],
     "--mesh 'data=4,tensor=2' with --pipeline-stages=2 adds the stage axis: mesh stage=2,data=4,tensor=2 needs 16"),
    (["--process-id", "1"], "process_id=1 needs coordinator and num_processes as well"),
    (["--num-processes", "2"], "num_processes=2 needs coordinator and process_id as well"),
    (["--remat", "offload", "--pipeline-stages", "2", "--microbatches", "2", "--pipeline-schedule", "1f1b",
      "--mesh", "stage=2,data=4"], "--remat offload with --pipeline-schedule 1f1b is not supported"),
    (["--model", "tiny-moe", "--lora-rank", "4", "--lora-targets", "wq,w_up"],
     "--lora-targets w_up with --model tiny-moe: not a weight of this model (its MLP is a mixture of experts); "
     "accepted: names among wq, wk, wv, wo, moe.expert_gate, moe.expert_up, moe.expert_down"),
    (["--model", "tiny", "--lora-rank", "4", "--lora-targets", "wq,moe.expert_up"],
     "--lora-targets moe.expert_up with --model tiny: not a weight of this model (its MLP is dense)"),
    (["--model", "tiny-moe", "--moe-dropless", "--moe-capacity-factor", "0.5"],
     "--moe-capacity-factor 0.5 with --moe-dropless does nothing (dropless routing has no capacity)"),
    (["--moe-experts", "4", "--pipeline-stages", "2", "--mesh", "stage=2", "--microbatches", "2"],
     "--pipeline-stages with --moe-experts 4 is not supported; accepted: dense models"),
    (["--rules", "emebd=fsdp"], "unknown logical axis 'emebd'; accepted: batch, length, embed"),
    (["--rules", "embed=fsdp+fsdp"], "rule embed=fsdp+fsdp names mesh axis 'fsdp' twice"),
    (["--rules", "length=tensor"], "--rules length=tensor needs a mesh (rules place logical axes on a mesh's axes); "
                                   "accepted: --rules with --mesh, --zero or --pipeline-stages"),  # was ignored
    # tiny has 4 query and 2 key/value heads: a tensor axis must keep whole heads on every device.
    (["--mesh", "stage=2,tensor=4", "--pipeline-stages", "2", "--microbatches", "2", "--pipeline-schedule", "1f1b",
      "--batch", "8"], "--mesh stage=2,tensor=4 with --model tiny: n_kv_heads=2 is not divisible by mesh axes "
                       "tensor of size 4"),
    (["--mesh", "tensor=8"], "--mesh tensor=8 with --model tiny: n_heads=4 is not divisible by mesh axes tensor of "
                             "size 8"),
    # Pipeline microbatches split each data-parallel group's accumulation microbatch (--accum > 1) or the
    # global batch, whose rows are sharded over the data-parallel devices (--accum 1).
    (["--batch", "8", "--accum", "2", "--mesh", "stage=2,fsdp=4", "--zero", "3", "--pipeline-stages", "2",
      "--microbatches", "2"], "--microbatches=2: --batch=8 split over the data-parallel size 4 (fsdp) and --accum 2 "
                              "leaves 1 row(s) per group and accumulation microbatch, which do not split into 2 "
                              "pipeline microbatches; accepted: --batch a multiple of 4 x 2 x 2 = 16"),
    (["--batch", "8", "--mesh", "stage=2,fsdp=4", "--pipeline-stages", "2", "--microbatches", "4"],
     "accepted: --batch a multiple of 4 x 1 x 4 = 16"),
    (["--galore-rank", "8"], "--galore-rank applies to --optimizer galore only; got --optimizer adafactor"),
    (["--optimizer", "galore", "--galore-rank", "0"], "--galore-rank=0 must be >= 1"),
    (["--optimizer", "galore", "--galore-gap", "0"], "--galore-gap=0 must be >= 1"),
    (["--optimizer", "galore", "--galore-scale", "nan"], "--galore-scale=nan must be a finite number > 0"),
    (["--layerwise", "-1"], "--layerwise=-1 must be >= 0"),
    (["--layerwise", "1", "--layerwise-period", "0"], "--layerwise-period=0 must be >= 1"),
    (["--layerwise", "1", "--layerwise-schedule", "sideways"],
     "--layerwise-schedule 'sideways'; accepted: random, bottom-up, top-down"),
    (["--layerwise", "3"], "--layerwise 3 exceeds the model's 2 layers; accepted: 1..2"),
    (["--layerwise-period", "5"], "--layerwise-period 5 needs --layerwise N (it sets how the active layers change)"),
    (["--layerwise-schedule", "top-down"], "--layerwise-schedule top-down needs --layerwise N"),
    (["--pipeline-schedule", "1f1b"], "--pipeline-schedule 1f1b needs --pipeline-stages > 1"),
    (["--moe-top-k", "1"], "--moe-top-k 1: the model's MLP is dense; accepted: the --moe-* flags with an MoE model"),
    (["--moe-experts", "4", "--moe-top-k", "5"], "--moe-experts 4 --moe-top-k 5: moe top_k=5; accepted: an integer in "
                                                 "1..n_experts=4"),
    (["--moe-experts", "4", "--moe-capacity-factor", "0"], "moe capacity_factor=0.0; accepted: a finite number > 0"),
    (["--moe-experts", "4", "--moe-aux-weight", "-1"], "LlamaConfig.moe_aux_weight=-1.0; accepted: a finite number"),
    (["--moe-experts", "-2"], "--moe-experts -2; accepted: an integer >= 1 (leave the flag out for the model's own "
                              "MLP)"),
    (["--rules", "layers=data", "--mesh", "stage=2,data=4", "--pipeline-stages", "2"],
     "--rules layers=data places 'layers' on data, but --pipeline-stages=2 runs each stage's layers on the 'stage' "
     "axis; accepted: layers=stage, or no 'layers' rule (it is added)"),
    (["--layerwise", "1", "--mesh", "stage=2,data=4", "--pipeline-stages", "2"],
     "--layerwise 1 runs in one process without pipeline stages; accepted: --pipeline-stages 1"),
    (["--layerwise", "1", "--offload-optimizer", "host"], "--layerwise 1 with --offload-optimizer host is not"),
    (["--lora-rank", "4", "--lora-dropout", "0.5", "--mesh", "stage=2", "--pipeline-stages", "2", "--microbatches",
      "2"], "--lora-dropout 0.5 with --pipeline-stages 2 is not supported (the pipeline schedule draws no dropout "
            "mask); accepted: --lora-dropout 0, or --pipeline-stages 1"),
    (["--precision", "p=f32,c=bf16,o=bf16"], "--precision='p=f32,c=bf16,o=bf16' asks for bfloat16 outputs; "
                                             "accepted: o=f32"),
    (["--stop-after", "2"], "--stop-after 2 needs --ckpt-dir (the checkpoint --resume continues from"),
    # Seeds 2**32 apart shared the init's key; chunk 0 failed while tracing the step.
    (["--seed", str(2**32 + 1)], "--seed=4294967297; accepted: an integer in 0..4294967295"),
    (["--loss-chunk", "0"], "--loss-chunk=0; accepted: an integer >= 1 (positions per chunk), or unset"),
    # An empty path (an unset shell variable) ran without the log, chart or checkpoints it named.
    (["--log", ""], "--log '': an empty path; accepted: a path, or leave the flag out"),
    (["--plot", " "], "--plot ' ': an empty path; accepted: a path, or leave the flag out"),
    (["--ckpt-dir", ""], "--ckpt-dir '': an empty path"),
    (["--save", ""], "--save '': an empty path"),
    (["--offload-dir", ""], "--offload-dir '': an empty path"),
])
def test_bad_numbers_and_parallel_flags_are_one_line_exit_2(argv, expected, capsys):
    assert expected in _one_line_exit_2(["--model", "tiny"] + argv, capsys)


def test_config_fields_of_the_wrong_kind_are_refused_and_numpy_scalars_become_python():
    """From Python: NumPy integers made the checkpoint meta and the log unwritable after training; a float
    step count failed after compiling (or checkpointed at odd steps); a string was a TypeError in a check."""
    cfg = TrainConfig(model="tiny", steps=np.int64(3), batch=np.int32(2), lr=1, seed=np.uint32(2))
    assert (type(cfg.steps), type(cfg.batch), type(cfg.lr), type(cfg.seed)) == (int, int, float, int)
    for kw, message in ((dict(steps=2.5), "--steps=2.5; accepted: an integer"),
                        (dict(ckpt_every=1.5), "--ckpt-every=1.5; accepted: an integer"),
                        (dict(steps=True), "--steps=True; accepted: an integer"),
                        (dict(lr="1e-3"), "--lr='1e-3'; accepted: a number"),
                        (dict(warmup=1.5), "--warmup=1.5; accepted: an integer or None"),
                        (dict(data=None), "--data=None; accepted: a string"),
                        (dict(resume=1), "--resume=1; accepted: True or False")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            TrainConfig(**kw)


def test_pipeline_stages_without_a_mesh_name_the_flag_not_a_mesh_never_given():
    from jmem.train.setup import mesh_for

    with pytest.raises(ValueError, match=r"^--pipeline-stages=3 needs a multiple of 3 devices, one stage per device "
                                         r"group; there are 8$"):
        mesh_for(TrainConfig(model="smollm2-135m", pipeline_stages=3))
    shape = mesh_for(TrainConfig(model="tiny", pipeline_stages=2)).shape
    assert (shape["stage"], shape["data"]) == (2, 4)


def test_mesh_flags_are_checked_before_the_model_is_built(monkeypatch, capsys):
    """Head and pipeline-microbatch checks cost one line, not a model build."""
    from jmem.train import setup

    def no_build(*a, **k):
        raise AssertionError("the model was built before the flags were checked")

    monkeypatch.setattr(setup, "_cached_fns", no_build)
    line = _one_line_exit_2(["--model", "tiny", "--mesh", "data=2,tensor=4"], capsys)
    assert "n_kv_heads=2 is not divisible by mesh axes tensor of size 4" in line
    line = _one_line_exit_2(["--model", "tiny", "--batch", "8", "--mesh", "stage=2,fsdp=4", "--pipeline-stages", "2",
                             "--microbatches", "4"], capsys)
    assert "--microbatches=4" in line


def test_a_preset_whose_parameters_do_not_fit_is_refused_before_it_is_built(monkeypatch, capsys):
    """Parameters and gradients above the device's memory: one line before the model is initialised (a
    preset with --moe-experts 100000 was killed while building its experts)."""
    import importlib

    measure = importlib.import_module("jmem.memory.measure")  # the module, not the function jmem.memory.measure
    monkeypatch.setattr(measure, "memory_limit", lambda: (2 << 20, "the device holds"))
    line = _one_line_exit_2(["--model", "tiny", "--moe-experts", "64"], capsys)
    assert line == ("error: --model tiny --moe-experts 64: 3.21M parameters need 25 MiB with their gradients and the "
                    "device holds 2 MiB; accepted: a smaller model, or a --mesh over more devices"), line
    line = _one_line_exit_2(["--model", "tiny", "--moe-experts", "64", "--lora-rank", "2", "--lora-targets", "wq"],
                            capsys)
    assert "parameters need 12 MiB and the device holds 2 MiB" in line, line


def test_resume_without_a_checkpoint_is_an_error_and_creates_nothing(tmp_path, capsys):
    absent = tmp_path / "absent"
    line = _one_line_exit_2(["--model", "tiny", "--ckpt-dir", str(absent), "--resume"], capsys)
    assert f"nothing to resume in {absent}" in line and not absent.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"nothing to resume in {empty}"):
        validate(TrainConfig(model="tiny", ckpt_dir=str(empty), resume=True))
    assert list(empty.iterdir()) == []
    (empty / "7" / "state").mkdir(parents=True)  # a numbered folder that is no jmem step (no meta item)
    with pytest.raises(ValueError, match=f"nothing to resume in {empty}"):  # was "--steps ... beyond step 7"
        validate(TrainConfig(model="tiny", steps=5, ckpt_dir=str(empty), resume=True))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    line = _one_line_exit_2(["--model", "tiny", "--ckpt-dir", str(a_file), "--resume"], capsys)
    assert f"--ckpt-dir {str(a_file)!r} is a file, not a checkpoint directory" in line, line


def test_a_run_refused_after_making_its_output_dirs_leaves_none_empty(tmp_path, capsys):
    """A sequence the tensor axis cannot split is found once the mesh exists, after the output
    directories were made: they go again (an existing one stays, with what it holds); the line
    names --seq."""
    ckpt, logs, kept = tmp_path / "new" / "ckpt", tmp_path / "logs", tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    line = _one_line_exit_2(["--model", "tiny", "--seq", "31", "--batch", "8", "--mesh", "data=4,tensor=2", "--rules",
                             "length=tensor", "--ckpt-dir", str(ckpt), "--log", str(logs / "log.jsonl"),
                             "--plot", str(kept / "loss.png")], capsys)
    assert line == ("error: --seq=31: dim 1 (length) has size 31, not divisible by mesh axes tensor of size 2; change "
                    "the mesh or the rule 'length=tensor' (e.g. 'length=none')")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]


def test_fresh_run_does_not_write_over_an_existing_log(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "loss": 5.0}\n')
    line = _one_line_exit_2(["--model", "tiny", "--log", str(log)], capsys)
    assert f"--log {str(log)!r} already holds another run's log" in line and "--resume" in line
    assert log.read_text() == '{"step": 0, "loss": 5.0}\n'
    log.write_text("")  # an empty file (e.g. from `touch`) holds nothing to lose
    validate(TrainConfig(model="tiny", log=str(log)))


def test_outputs_at_one_path_or_inside_save_are_refused_before_the_run(tmp_path):
    """Two outputs at one path overwrote one another (a PNG over the log, the adapters over the log), and an
    output inside --save filled it, so the save was refused after the whole run."""
    def cfg(**kw):
        return TrainConfig(model="tiny", **{k: str(tmp_path / v) for k, v in kw.items()})

    for kw, message in [(dict(log="a.png", plot="a.png"), "--log '{log}' and --plot '{plot}' are one path"),
                        (dict(ckpt_dir="o", save="o"), "--ckpt-dir '{ckpt_dir}' and --save '{save}' are one path"),
                        (dict(log="s/log.jsonl", save="s"), "--log '{log}' is inside --save '{save}', which must"),
                        (dict(ckpt_dir="s/ck", save="s"), "--ckpt-dir '{ckpt_dir}' is inside --save"),
                        (dict(log="x/../a.jsonl", plot="a.jsonl"), "are one path"),
                        # The step-2 checkpoint replaced the log; the save was refused after the run.
                        (dict(ckpt_dir="ck", log="ck/2"), "--log '{log}' is at a step folder's name inside"),
                        (dict(ckpt_dir="ck", save="ck/10/m"), "--save '{save}' is at a step folder's name inside")]:
        with pytest.raises(ValueError, match=re.escape(message.format(**{k: tmp_path / v for k, v in kw.items()}))):
            validate(cfg(**kw))
    with pytest.raises(ValueError, match="--log .* and --save .* are one path"):
        validate(dataclasses.replace(cfg(log="a.npz", save="a.npz"), lora_rank=2))
    assert list(tmp_path.iterdir()) == []  # refused before any output directory is made
    validate(cfg(ckpt_dir="ck", log="ck/log.jsonl", save="model"))  # a log beside the checkpoints is fine
    validate(cfg(ckpt_dir="ck", log="ck/02"))  # no step folder is named "02"


def test_model_file_must_be_gguf(tmp_path):
    (tmp_path / "x.txt").write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        validate(TrainConfig(model=str(tmp_path / "x.txt")))
    validate(TrainConfig(model="tiny", seq=4096))  # a preset from scratch grows its max_seq_len


def test_seq_beyond_smollm2_context_is_refused(capsys):
    from jmem.lm import packaged_model_path

    try:
        packaged_model_path("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    line = _one_line_exit_2(["--model", "smollm2-135m", "--seq", "8193"], capsys)
    assert "--seq=8193 exceeds the context length 8192 of --model smollm2-135m" in line


def test_jit_cache_follows_its_train_fns():
    """A new TrainFns (even at a reused address) gets its own step; dead ones leave the cache."""
    run = types.SimpleNamespace(mesh=None, cfg=None)
    for i in range(12):
        fns = TrainFns(init_state=None, step=lambda s, b, i=i: s, eval_loss=lambda p, b, i=i: p, merge=None)
        run.fns = fns
        step, _ = loop._jitted(run, None)
        assert step.__wrapped__ is fns.step and loop._jitted_eval(fns).__wrapped__ is fns.eval_loss
        del fns, step
        run.fns = None
    gc.collect()
    assert len(loop._JIT_CACHE) <= 4  # at most the live entries of setup's LRU of 4 builds


def test_1f1b_memory_table_counts_the_busiest_stage():
    """Under 1F1B the table's matmul FLOPs are `busiest_stage_matmul_flops` with --microbatches x
    --accum ticks of each kind, labelled so; other runs keep the report's own count."""
    from jmem import parallel as par
    from jmem.memory.hlo_flops import matmul_flops
    from jmem.memory.measure import measure_and_compile

    def tick(i, x, w):  # idle, "forward", "backward" (twice the matmuls), as a 1F1B tick switch
        return jax.lax.switch(i, [lambda x: x, lambda x: x @ w, lambda x: (x @ w) @ w], x) @ w

    report, compiled = measure_and_compile(tick, 1, jnp.ones((8, 32)), jnp.ones((32, 32)))
    text = compiled.as_text()
    one = 2 * 8 * 32 * 32
    assert par.busiest_stage_matmul_flops(text, 1) == matmul_flops(text, differing="zero") + 3 * one
    cfg = TrainConfig(pipeline_stages=2, microbatches=4, accum=2, batch=16, pipeline_schedule="1f1b")
    label, flops = report_mod.step_matmul_flops(cfg, report, compiled)
    assert label == "busiest pipeline stage" and flops == matmul_flops(text, differing="zero") + 8 * 3 * one
    assert "matmul GFLOPs per step (busiest pipeline stage)" in report_mod.memory_table(report, {}, (label, flops))
    on_mesh = report_mod.memory_table(report, {"total": 1}, (label, flops), devices=8).splitlines()
    assert on_mesh[0].startswith("memory of one train step [cpu], per device of 8")
    assert on_mesh[-1] == "  (estimated: the whole step on one device, unsharded)"
    # The CPU backend computes bf16 in f32: a bf16 step measures above its estimate there.
    widened = report_mod.memory_table(report, {"total": 1}, compute_dtype=jnp.bfloat16).splitlines()[-1]
    assert widened == "  (estimated: bfloat16 activations; the CPU backend computes them in f32)"
    assert "CPU backend" not in report_mod.memory_table(report, {"total": 1}, compute_dtype=jnp.float32)
    # XLA's peak: shown off the CPU (a TPU target's temp misses a small program's activations), not on it.
    assert "XLA's peak" not in report_mod.memory_table(dataclasses.replace(report, peak_bytes=2**30), {})
    tpu = report_mod.memory_table(dataclasses.replace(report, peak_bytes=3 * 2**20, target="tpu:v5e:2x2"), {})
    assert "  measured  XLA's peak                                  3.00" in tpu.splitlines()
    gpipe = dataclasses.replace(cfg, pipeline_schedule="gpipe")
    assert report_mod.step_matmul_flops(gpipe, report, compiled) == ("every loop iteration", report.matmul_flops)
    # An estimate's trainable and frozen bytes are parts of its params, shown under them (they read as rows
    # of their own: the estimated rows summed to more than the total).
    est = {"trainable": 2**20, "frozen": 3 * 2**20, "params": 4 * 2**20, "grads": 2**20, "total": 5 * 2**20}
    rows = [line for line in report_mod.memory_table(report, est).splitlines() if "estimated" in line]
    assert rows == ["  estimated params                                      4.00",
                    "  estimated   of which trainable                        1.00",
                    "  estimated   of which frozen                           3.00",
                    "  estimated grads                                       1.00",
                    "  estimated total                                       5.00"]


def test_processes_compare_paths_in_normal_form():
    """`--ckpt-dir /x/run/` on one process and `/x/run` on another name one directory: not a difference."""
    from jmem.train.setup import shared_flags

    a = shared_flags(TrainConfig(model="tiny", ckpt_dir="/x/run/", save="out/./model"))
    b = shared_flags(TrainConfig(model="tiny", ckpt_dir="/x/run", save="out/model"))
    assert a == b and a["--ckpt-dir"] == "/x/run" and "--process-id" not in a
    # Each process reaches process 0 by its own address (localhost on process 0, an IP elsewhere): having
    # joined one job, they agree on it; --coordinator localhost:P vs 127.0.0.1:P was "flags differ".
    assert shared_flags(TrainConfig(model="tiny", coordinator="localhost:5")) == \
        shared_flags(TrainConfig(model="tiny", coordinator="127.0.0.1:5"))
    assert shared_flags(TrainConfig(model="tiny", lr=1e-2)) != shared_flags(TrainConfig(model="tiny"))
