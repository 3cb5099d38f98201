"""ZeRO-Offload (optimizer state + master weights on the host), parameter offload (layers in
host memory, fetched per layer) and ZeRO-Infinity (optimizer state in files, chunked update):
same training as on device, and the device program's bytes measured by the compiler."""

import functools
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jmem.memory.disk_offload import DiskOptimizer, placeholder_transform
from jmem.memory.measure import measure, tree_bytes
from jmem.memory.offload import (OffloadedTrainStep, OffloadError, argument_bytes_by_space, check_offload,
                                 host_memory_kind)
from jmem.memory.precision import with_master_weights
from jmem.models import Llama, LlamaConfig
from jmem.optim.adafactor import adafactor
from jmem.train import make_train_fns

STEPS = 3


def _batches(batch=4, seq=16, seed=1):
    ids = np.random.default_rng(seed).integers(0, 259, (STEPS, batch, seq + 1)).astype(np.int32)
    return [{"inputs": i[:, :-1], "targets": i[:, 1:], "mask": np.ones((batch, seq), np.float32)} for i in ids]


def _tx(name):
    opt = optax.adamw(1e-2, weight_decay=0.1) if name == "adamw" else adafactor(1e-2)
    return optax.chain(optax.clip_by_global_norm(1.0), opt)


def _model(param_dtype="float32", remat="full"):
    cfg = LlamaConfig.tiny(loss_chunk=16, remat=remat, param_dtype=param_dtype, compute_dtype=param_dtype)
    return Llama(cfg, rngs=nnx.Rngs(0))


@functools.lru_cache(maxsize=None)
def _reference(name):
    """Params after STEPS on-device steps, and the compiled step's memory."""
    model = _model()
    fns = make_train_fns(model, _tx(name))
    state = fns.init_state(model)
    step = jax.jit(fns.step)
    report = measure(step, state, _batches()[0])
    opt_bytes = tree_bytes(state.opt_state)
    for b in _batches():
        state, _ = step(state, b)
    return jax.tree.map(np.asarray, state.params), report, opt_bytes


def _offloaded(tx, params="none", accum=1, **kw):
    model = _model()
    fns = make_train_fns(model, tx, accum=accum)
    state = fns.init_state(model)
    trainer = OffloadedTrainStep(fns, jax.eval_shape(lambda: state), params=params, **kw)
    return trainer, trainer.place(state)


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_check_offload_names_bad_values():
    for kwargs, words in ((dict(optimizer="nvme"), "accepted: none, host, disk"),
                          (dict(params="disk"), "accepted: none, host"),
                          (dict(optimizer="disk"), "--offload-dir"),
                          (dict(optimizer="host", directory="/tmp/x"), "only used with offload optimizer 'disk'"),
                          (dict(params="host"), "needs offload optimizer 'host' or 'disk'")):
        with pytest.raises(OffloadError, match=words):
            check_offload(**kwargs)
    check_offload("disk", "host", "/tmp/x")  # a valid combination passes
    assert host_memory_kind() == "pinned_host"


def test_argument_bytes_by_space_reads_the_entry_layout():
    text = ("HloModule m, is_scheduled=true, entry_computation_layout={(f32[2,64,64]{2,1,0:S(5)}, bf16[8,4]{1,0}, "
            "s32[])->(f32[2]{0}, f32[2,8]{1,0:S(5)})}, allow_spmd_sharding_propagation_to_parameters={false}")
    assert argument_bytes_by_space(text) == (8 * 4 * 2 + 4, 2 * 64 * 64 * 4)
    assert argument_bytes_by_space(text, outputs=True) == (2 * 4, 2 * 8 * 4)


@pytest.mark.parametrize("name", ["adamw", pytest.param("adafactor", marks=pytest.mark.slow)])
def test_host_optimizer_offload_trains_identically_and_frees_the_state_bytes(name):
    ref_params, ref_report, opt_bytes = _reference(name)
    trainer, state = _offloaded(_tx(name))
    batches = _batches()
    report = trainer.measure(state, batches[0])
    for b in batches:
        state, metrics = trainer(state, b)
    assert _max_diff(state.params, ref_params) <= 1e-6
    assert all(x.sharding.device_set <= set(jax.devices("cpu")) for x in jax.tree.leaves(state.opt_state))
    # The device program no longer takes the optimizer state: its arguments shrink by exactly those bytes.
    drop = ref_report.argument_bytes - report.device.argument_bytes
    assert 0.99 <= drop / opt_bytes <= 1.01
    assert report.host_state_bytes == opt_bytes and report.host_argument_bytes == 0
    # The whole device program (no donation here) drops at least the state it no longer takes.
    assert ref_report.total_bytes - report.device_total_bytes >= opt_bytes


def test_parameter_offload_keeps_layers_in_host_memory_and_trains_identically():
    ref_params, ref_report, _ = _reference("adamw")
    trainer, state = _offloaded(_tx("adamw"), params="host")
    kinds = {k: {x.sharding.memory_kind for x in jax.tree.leaves(v)} for k, v in state.params.items()}
    assert kinds["layers"] == {"pinned_host"} and kinds["embed"] == {"device"}
    batches = _batches()
    report = trainer.measure(state, batches[0])
    layer_bytes = tree_bytes(state.params["layers"])
    other_bytes = tree_bytes(state.params) - layer_bytes
    # Compiler-placed: the stacked layers are host arguments, the device keeps the rest (+ batch, scalars).
    assert report.host_argument_bytes == layer_bytes
    assert other_bytes <= report.device_argument_bytes <= other_bytes + tree_bytes(batches[0]) + 64
    assert report.device_argument_bytes / (report.device_argument_bytes + layer_bytes) < 0.5
    assert report.host_output_bytes == layer_bytes  # their gradients leave the scan in host memory
    for b in batches:
        state, _ = trainer(state, b)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params["layers"])} == {"pinned_host"}
    assert _max_diff(state.params, ref_params) <= 1e-6


def test_parameter_offload_accumulates_layer_gradients_in_host_memory():
    """accum=2: the offloaded layers' gradients are summed where they arrive (host memory), and the
    step equals the on-device step at the same accumulation."""
    model = _model()
    fns = make_train_fns(model, _tx("adamw"), accum=2)
    state, step = fns.init_state(model), jax.jit(fns.step)
    trainer, off_state = _offloaded(_tx("adamw"), params="host", accum=2)
    report = trainer.measure(off_state, _batches()[0])
    assert report.host_output_bytes == tree_bytes(off_state.params["layers"])
    for b in _batches():
        state, _ = step(state, b)
        off_state, _ = trainer(off_state, b)
    assert _max_diff(off_state.params, state.params) <= 1e-6


def _sharded_run(offload, mesh, zero, *, param_dtype="float32", accum=1, loss_scale=False, master=False):
    """State after STEPS steps on `mesh`: `OffloadedTrainStep` (layers in host memory too) when `offload`,
    else `jit_train_step`'s on-device step."""
    from jmem import parallel as par
    from jmem.memory.precision import DynamicLossScale

    model = _model(param_dtype)
    tx = with_master_weights(_tx("adamw")) if master else _tx("adamw")
    if not offload:
        tx = par.constrain_gradients(tx, mesh, stage=zero)
    fns = make_train_fns(model, tx, mesh=mesh, zero=zero, accum=accum,
                         loss_scale=DynamicLossScale.create() if loss_scale else None)
    state = fns.init_state(model)
    if offload:
        trainer = OffloadedTrainStep(fns, jax.eval_shape(lambda: state), mesh=mesh, zero=zero, params="host")
        state = trainer.place(state)
        step = lambda s, b: trainer(s, trainer.place_batch(b))  # noqa: E731
    else:
        step, sh, _ = par.jit_train_step(fns.step, jax.eval_shape(lambda: state), mesh, zero=zero)
        state = jax.device_put(state, sh)
    for b in _batches(batch=8 * accum):
        state, _ = step(state, b)
    return state


@pytest.mark.slow
def test_offload_with_zero2_bf16_master_weights_matches_the_sharded_step():
    """ZeRO-2 on 8 devices, bf16 params with f32 master weights in the optimizer state, layers
    offloaded too: equal to `jit_train_step`'s on-device ZeRO-2 step; the state stays sharded."""
    from jmem import parallel as par

    mesh = par.make_mesh("data=4,fsdp=2")
    ref, off = (_sharded_run(offload, mesh, 2, param_dtype="bfloat16", master=True) for offload in (False, True))
    assert _max_diff((ref.params, ref.opt_state), (off.params, off.opt_state)) == 0.0
    master = off.opt_state.master["layers"]["wq"]["kernel"]
    assert master.dtype == np.float32 and len(master.sharding.device_set) == 8
    assert master.sharding.shard_shape(master.shape) != master.shape  # each device holds its ZeRO shard


@pytest.mark.parametrize("accum, loss_scale", [(2, False), (1, True)])
def test_offload_on_a_mesh_with_accumulation_or_loss_scaling_matches_the_sharded_step(accum, loss_scale):
    """Layer gradients summed over microbatches where they arrive (host memory), not in per-group
    device accumulators (an add across memory spaces failed to trace); the fp16 loss scale on the
    host mesh beside the gradients (one host device failed against 8)."""
    from jmem import parallel as par

    mesh = par.make_mesh("data=8")
    ref, off = (_sharded_run(offload, mesh, 1, accum=accum, loss_scale=loss_scale) for offload in (False, True))
    # With accum=2 the device step sums each data group's rows, the offloaded one contiguous
    # microbatches: the same gradient up to f32 rounding, which Adam's normalisation lifts for
    # entries with near-zero gradients (3 steps of lr 1e-2 move a weight up to 3e-2). With accum=1
    # the math is the same and the two programs round apart by an amount the CPU's vector code sets
    # (1.006e-6 on one machine).
    assert _max_diff(ref.params, off.params) <= (2e-4 if accum > 1 else 4e-6)
    if loss_scale:
        assert float(off.loss_scale.scale_value) == float(ref.loss_scale.scale_value)


def test_offload_refuses_zero3():
    from jmem import parallel as par

    model = _model()
    mesh = par.make_mesh("fsdp=8")
    fns = make_train_fns(model, _tx("adamw"), mesh=mesh, zero=3)
    with pytest.raises(OffloadError, match="--zero 3"):
        OffloadedTrainStep(fns, jax.eval_shape(lambda: fns.init_state(model)), mesh=mesh, zero=3)
    plain = make_train_fns(model, _tx("adamw"))
    with pytest.raises(OffloadError, match=r"^zero=1 without a mesh; accepted: zero=0, or a mesh"):  # ignored before
        OffloadedTrainStep(plain, jax.eval_shape(lambda: plain.init_state(model)), zero=1)


def _fixed_grads(train, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: (rng.normal(size=x.shape) * 1e-2).astype(x.dtype), train)


def _stacked_params(dtype, seed=0):
    """A model-shaped tree: stacked `layers` leaves (one factored by adafactor: both dims >= 128)
    and unstacked ones."""
    rng = np.random.default_rng(seed)
    shapes = {"embed": {"embedding": (96, 32)}, "layers": {"w": {"kernel": (3, 128, 160)}, "norm": {"scale": (3, 32)}},
              "head": {"kernel": (32, 96)}}
    return jax.tree.map(lambda shape: (rng.normal(size=shape) * 0.1).astype(dtype), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


@pytest.mark.parametrize("name,param_dtype", [("adamw", "float32"), ("adafactor", "float32"),
                                              ("adafactor", "bfloat16")])
def test_disk_optimizer_matches_the_in_memory_update(tmp_path, name, param_dtype):
    """Three updates from the files, one layer slice at a time, against the whole-tree optax update
    on the same gradients. The chunked and whole-tree programs are fused differently by XLA, so
    f32 values agree to rounding (a few ulp), not bit for bit."""
    import ml_dtypes

    params = _stacked_params(ml_dtypes.bfloat16 if param_dtype == "bfloat16" else np.float32)
    base = (lambda t: with_master_weights(t)) if param_dtype != "float32" else (lambda t: t)
    opt = optax.adamw(1e-2, weight_decay=0.1) if name == "adamw" else adafactor(1e-2)
    whole = base(optax.chain(optax.clip_by_global_norm(1.0), opt))
    disk = DiskOptimizer(base(opt), params, str(tmp_path / "opt"), clip=1.0)
    assert len(disk.chunks) == 2 * 3 + 2  # one chunk per layer slice of each stacked leaf, + 2 others
    assert disk.chunk_bytes < disk.total_bytes / 2  # host memory holds one chunk of the state at a time
    state = whole.init(params)
    handle = disk.place(params)
    update = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*whole.update(g, s, p)))
    p_mem = p_disk = params
    for k in range(STEPS):
        grads = _fixed_grads(params, k)
        p_mem, state = update(grads, state, p_mem)
        p_disk, handle = disk.update(grads, handle, p_disk)
    assert int(handle.updates) == STEPS
    assert _max_diff(p_mem, params) > 1e-3  # the updates moved the params
    if param_dtype == "float32":
        for a, b in zip(jax.tree.leaves(p_mem), jax.tree.leaves(p_disk)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-6, atol=1e-7)
    else:  # the f32 master weights on disk against the in-memory ones; the bf16 params are their rounding
        idx = _leaf_index(params, ("layers", "w", "kernel"))
        saved = disk.read_state()  # per chunk: the master slice first (MasterWeightsState.master)
        w = np.concatenate([saved[c][0] for c, (i, _) in enumerate(disk.chunks) if i == idx])
        np.testing.assert_allclose(w, np.asarray(state.master["layers"]["w"]["kernel"]), rtol=2e-6, atol=1e-7)
        a, b = (np.asarray(t["layers"]["w"]["kernel"], np.float32) for t in (p_mem, p_disk))
        assert np.mean(a != b) < 1e-3  # equal unless a master value sits on a bf16 rounding edge
    files = sorted(p.name for p in (tmp_path / "opt").iterdir())
    assert "chunks.json" in files and len(files) > len(disk.chunks)
    # The directory reused for a smaller tree: the earlier run's extra chunk files go.
    disk.close()
    small = DiskOptimizer(base(opt), {"head": params["head"]}, str(tmp_path / "opt"))
    small.place({"head": params["head"]})
    names = {f.name for c in range(len(small.chunks)) for f in small._files(c)}
    assert {p.name for p in (tmp_path / "opt").glob("*.npy")} == names


@pytest.mark.parametrize("name", ["adamw_bf16_mu", "adafactor_momentum"])
def test_bf16_optimizer_state_goes_through_the_files(tmp_path, name):
    """State leaves in bfloat16 (adamw's `mu_dtype`, adafactor's momentum) were written as raw `.npy`
    bytes and read back as void: the first update failed inside JAX, and a snapshot read as damaged."""
    import jax.numpy as jnp

    params = _stacked_params(np.float32)
    opt = optax.adamw(1e-2, mu_dtype=jnp.bfloat16) if name == "adamw_bf16_mu" else adafactor(1e-2, momentum=0.9)
    disk = DiskOptimizer(opt, params, str(tmp_path / "opt"))
    state, handle = opt.init(params), disk.place(params)
    update = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*opt.update(g, s, p)))
    p_mem = p_disk = params
    for k in range(STEPS):
        if k == 1:  # a snapshot after the first step, restored: the run goes on from it
            disk.snapshot(str(tmp_path / "snap"))
            disk.restore(str(tmp_path / "snap"))
        grads = _fixed_grads(params, k)
        p_mem, state = update(grads, state, p_mem)
        p_disk, handle = disk.update(grads, handle, p_disk)
    assert _max_diff(p_mem, params) > 1e-3
    for a, b in zip(jax.tree.leaves(p_mem), jax.tree.leaves(p_disk)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-6, atol=1e-6)
    assert any(x.dtype == jnp.bfloat16 for c in disk.read_state() for x in c)


def test_disk_snapshot_never_deletes_files_it_did_not_write(tmp_path):
    params = _stacked_params(np.float32)
    disk = DiskOptimizer(optax.adamw(1e-2), params, str(tmp_path / "opt"))
    disk.place(params)
    live = sorted(p.name for p in (tmp_path / "opt").iterdir())
    with pytest.raises(OffloadError, match="is the live state directory .*; accepted: another directory"):
        disk.snapshot(str(tmp_path / "opt"))
    assert sorted(p.name for p in (tmp_path / "opt").iterdir()) == live
    disk.snapshot(str(tmp_path / "opt" / "snap"))  # a folder inside: the state files are the top-level ones
    disk.place(params)
    assert sorted(p.name for p in (tmp_path / "opt" / "snap").iterdir()) == sorted(set(live) - {".lock"})
    disk.restore(str(tmp_path / "opt" / "snap"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "params.msgpack").write_text("weights")
    with pytest.raises(OffloadError, match=r"holds other files \(params.msgpack\); accepted: a new or empty"):
        disk.snapshot(str(ckpt))
    assert [p.name for p in ckpt.iterdir()] == ["params.msgpack"]
    # An earlier snapshot of more chunks is replaced whole; the new one restores.
    bigger = DiskOptimizer(optax.adamw(1e-2), params, str(tmp_path / "opt2"), layer_chunks=False)
    bigger.place(params)
    small = DiskOptimizer(optax.adamw(1e-2), {"head": params["head"]}, str(tmp_path / "opt3"))
    small.place({"head": params["head"]})
    bigger.snapshot(str(tmp_path / "snap"))
    small.snapshot(str(tmp_path / "snap"))
    names = [sorted(p.name for p in (tmp_path / d).iterdir() if p.name != ".lock") for d in ("snap", "opt3")]
    assert names[0] == names[1]  # the state files (the live directory's lock is no state)
    small.restore(str(tmp_path / "snap"))


def test_a_damaged_snapshot_is_one_error_naming_its_file(tmp_path):
    """A snapshot missing a state file, with a truncated one, or with one of another shape was read
    (a FileNotFoundError traceback, numpy's "EOF: reading array header", a broadcasting error)."""
    from jmem.memory.disk_offload import check_snapshot

    params = {"head": np.ones((4, 3), np.float32), "b": np.ones((5,), np.float32)}
    disk = DiskOptimizer(optax.adamw(1e-2), params, str(tmp_path / "opt"))
    disk.place(params)
    snap = tmp_path / "ck" / "offload_optimizer" / "2"
    disk.snapshot(str(snap))
    check_snapshot(snap)
    disk.restore(str(snap))
    for i, (damage, why) in enumerate([
            (lambda f: f.unlink(), r"chunk00001_1.npy is missing"),
            (lambda f: f.write_bytes(f.read_bytes()[:140]), r"chunk00001_1.npy: mmap length is greater than file "
                                                            r"size"),  # 12 of its 48 data bytes
            (lambda f: np.save(f, np.zeros((2,), np.float32)), r"chunk00001_1.npy holds float32\[2\]; expected "
                                                               r"float32\[4, 3\]"),
            (lambda f: f.write_bytes(b"junk"), r"chunk00001_1.npy: ")]):
        copy = tmp_path / f"ck{i}" / "offload_optimizer" / "2"
        shutil.copytree(snap, copy)
        damage(copy / "chunk00001_1.npy")
        message = (f"optimizer-state snapshot {copy} is damaged \\({why}.*\\); accepted: a complete snapshot: "
                   f"delete the checkpoint {tmp_path / f'ck{i}' / '2'} to resume from the step before it")
        for read in (check_snapshot, disk.restore):
            with pytest.raises(OffloadError, match=message):
                read(copy)
    with pytest.raises(OffloadError, match="is the live state directory; accepted: an --offload-dir outside"):
        disk.restore(str(tmp_path / "opt"))


def test_a_full_disk_while_writing_or_copying_the_state_is_one_error(tmp_path, monkeypatch):
    """No space for a new state file's header (before any fallocate) or for a snapshot's copy was a raw
    OSError traceback, and the partial snapshot stayed behind filling the disk."""
    import errno
    import os

    from jmem.memory import disk_offload
    from jmem.memory.disk_offload import OffloadWriteError

    params = {"head": np.ones((4, 3), np.float32)}
    disk = DiskOptimizer(optax.adamw(1e-2), params, str(tmp_path / "opt"))
    disk.place(params)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(np.lib.format, "open_memmap", full)
        with pytest.raises(OffloadWriteError, match=r"cannot write the optimizer state file .*chunk00000_0.npy "
                                                    r"\(No space left on device\); the state files may now be "
                                                    "partly updated"):
            disk.place(params)
    copies = []

    def copy_then_full(src, dst):
        copies.append(dst)
        if len(copies) > 1:
            full()
        return shutil.copyfile(src, dst)

    monkeypatch.setattr(disk_offload.shutil, "copyfile", copy_then_full)
    with pytest.raises(OffloadWriteError, match=r"cannot write the optimizer-state snapshot .*snap \(No space left "
                                                r"on device\); the checkpoint was not saved"):
        disk.snapshot(str(tmp_path / "snap"))
    assert not (tmp_path / "snap").exists()


def _leaf_index(tree, path):
    for i, (p, _) in enumerate(jax.tree_util.tree_leaves_with_path(tree)):
        if tuple(str(getattr(k, "key", k)) for k in p) == path:
            return i
    raise KeyError(path)


@pytest.mark.slow
def test_disk_offload_step_frees_device_and_host_state(tmp_path):
    model = _model()
    fns = make_train_fns(model, placeholder_transform())
    state = fns.init_state(model)
    assert tree_bytes(state.opt_state) == 4  # the train state holds only the update count
    disk = DiskOptimizer(optax.adamw(1e-2), fns.trainable(jax.eval_shape(lambda: state.params))[0],
                         str(tmp_path / "opt"), clip=1.0)
    trainer = OffloadedTrainStep(fns, jax.eval_shape(lambda: state), disk=disk)
    state = trainer.place(state)
    report = trainer.measure(state, _batches()[0])
    params_bytes = tree_bytes(state.params)
    # adam: mu and nu in f32, and each chunk's i32 update count
    assert report.disk_state_bytes == disk.total_bytes == 2 * params_bytes + 4 * len(disk.chunks)
    assert report.host_state_bytes == 0 and report.host_chunk_bytes == disk.chunk_bytes
    ref_params, ref_report, opt_bytes = _reference("adamw")
    assert abs(opt_bytes - disk.total_bytes) <= 4 * len(disk.chunks)  # the same state, now in files
    state, metrics = trainer(state, _batches()[0])
    assert np.isfinite(float(metrics["loss"])) and int(state.opt_state.updates) == 1


def test_a_disk_state_directory_in_use_by_another_process_is_refused(tmp_path):
    """Two runs rewriting one directory's files corrupted each other's state (one of them silently)."""
    import subprocess
    import sys

    params = {"head": np.ones((4, 3), np.float32)}
    (tmp_path / "opt").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(tmp_path / "opt" / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OffloadError, match=r"offload directory .*opt is in use by another running process's "
                                               r"optimizer state"):
            DiskOptimizer(optax.adamw(1e-2), params, str(tmp_path / "opt"))
    finally:
        holder.kill()
        holder.wait()
    first = DiskOptimizer(optax.adamw(1e-2), params, str(tmp_path / "opt"))  # free again
    first.place(params)
    # A second optimizer of this process on it deleted the first's files in place(): a FileNotFoundError
    # in the first's next update.
    with pytest.raises(OffloadError, match=r"offload directory .*opt is in use by another DiskOptimizer of this "
                                           r"process .*; accepted: close\(\) the other first"):
        DiskOptimizer(optax.adamw(1e-2), params, str(tmp_path / "opt"))
    first.close()
    DiskOptimizer(optax.adamw(1e-2), params, str(tmp_path / "opt")).place(params)  # closed: free
    DiskOptimizer(optax.adamw(1e-2), params, str(tmp_path / "opt"))  # the one before was garbage: free


def test_disk_optimizer_refuses_a_bad_clip_or_directory(tmp_path):
    """clip=-1 stepped uphill (a negative clipping factor), clip=nan made every weight NaN; directory ''
    was the working directory, whose chunk files place() deletes."""
    params = {"head": np.ones((4, 3), np.float32)}
    for clip in (-1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(OffloadError, match=rf"^clip={clip!r}; accepted: a finite number >= 0"):
            DiskOptimizer(optax.sgd(0.1), params, str(tmp_path / "opt"), clip=clip)
    for directory in ("", None):
        with pytest.raises(OffloadError, match=rf"^offload directory {directory!r}; accepted: a non-empty path$"):
            DiskOptimizer(optax.sgd(0.1), params, directory)


def test_a_full_disk_is_one_error_not_a_bus_error(tmp_path, monkeypatch):
    """The memmapped files were sparse: a full disk surfaced as SIGBUS when their pages were written."""
    import errno
    import os

    from jmem.memory.disk_offload import OffloadWriteError

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    params = {"head": np.ones((4, 3), np.float32)}
    disk = DiskOptimizer(optax.adamw(1e-2), params, str(tmp_path / "opt"))
    with pytest.raises(OffloadWriteError, match=r"cannot write the optimizer state file .*No space left on device"):
        disk.place(params)
