"""--save: a finished run writes its trained model (a directory `jmem.load` reads) or, with LoRA,
its adapters (an .npz file `jmem serve --lora-modules` reads) or its merged model (a directory), equal
to the run's final parameters."""

import dataclasses
import io

import jax
import numpy as np
import pytest
from flax import nnx

import jmem
from jmem.io.checkpoint import Checkpointer
from jmem.lora import adapter_arrays, load_adapters
from jmem.train import TrainConfig, train
from jmem.train.setup import build

BASE = dict(model="tiny", steps=3, batch=4, seq=16, progress=False, eval_batches=1)


def _final_params(cfg: TrainConfig):
    """The run's last parameters, restored from its checkpoint, as a pure dict of the merged model."""
    run = build(dataclasses.replace(cfg, save=None))  # the saved output exists by now
    state = Checkpointer(cfg.ckpt_dir).restore(run.fns.init_state(run.model))
    return run.fns.merge(state.params)


def _params(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_saved_model_is_the_trained_model(tmp_path):
    cfg = TrainConfig(**BASE, ckpt_dir=str(tmp_path / "ck"), save=str(tmp_path / "model"))
    train(dataclasses.replace(cfg, stop_after=1), out=io.StringIO())
    assert not (tmp_path / "model").exists()  # written when the run finishes, not before
    out = io.StringIO()
    train(dataclasses.replace(cfg, resume=True), out=out)
    assert f"wrote the trained model to {tmp_path / 'model'}" in out.getvalue()
    loaded = jmem.load(str(tmp_path / "model"))
    saved, trained = _params(loaded.model), _params(_final_params(cfg))
    jax.tree.map(np.testing.assert_array_equal, saved, trained)
    # Trained with bf16 compute, it computes as every model file loads (f32), like its base with adapters.
    assert (cfg.precision, loaded.config.compute_dtype, loaded.config.attention_impl) == ("bf16", "f32", "xla")
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(saved),
                                                         jax.tree.leaves(_params(jmem.load("tiny").model))))


def test_a_signal_in_the_last_step_still_saves(tmp_path):
    """A signal in the last step stopped the run before its final eval and --save, and --resume then had no
    step left to train: the export was lost."""
    import os
    import signal

    def sigterm_in_last_step(rec):
        if rec["step"] == BASE["steps"]:
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = TrainConfig(**BASE, ckpt_dir=str(tmp_path / "ck"), save=str(tmp_path / "model"))
    out = io.StringIO()
    result = train(cfg, out=out, on_step=sigterm_in_last_step)
    assert not result.interrupted and sorted(result.eval_losses) == [3] and "interrupted" not in out.getvalue()
    assert "signal after the last step: the run is complete; --save, then the final eval" in out.getvalue()
    jax.tree.map(np.testing.assert_array_equal, _params(jmem.load(str(tmp_path / "model")).model),
                 _params(_final_params(cfg)))


def test_saved_adapters_are_the_trained_adapters(tmp_path):
    path = tmp_path / "adapters.npz"
    cfg = TrainConfig(**BASE, lora_rank=4, lora_targets="wq,wv", ckpt_dir=str(tmp_path / "ck"), save=str(path))
    train(cfg, out=io.StringIO())
    served = load_adapters(jmem.load("tiny").model, path)  # the base the run started from: the preset's
    trained = adapter_arrays(_final_params(cfg))
    assert set(adapter_arrays(served)) == set(trained) and len(trained) == 4
    for k, v in adapter_arrays(served).items():
        np.testing.assert_array_equal(v, trained[k])


def test_a_lora_run_saved_to_a_directory_is_the_merged_model(tmp_path):
    """--lora-rank with --save DIR: the model with its adapters merged (adapters on an MoE model's experts,
    which `jmem serve --lora-modules` does not batch, serve this way), equal to merging the trained adapters."""
    from jmem.lora import merge

    cfg = TrainConfig(**{**BASE, "model": "tiny-moe"}, lora_rank=4, ckpt_dir=str(tmp_path / "ck"),
                      save=str(tmp_path / "merged"))
    out = io.StringIO()
    train(cfg, out=out)
    assert f"wrote the model with its adapters merged into its weights to {tmp_path / 'merged'}" in out.getvalue()
    trained = _final_params(cfg)
    assert type(trained.layers.moe.expert_up.get_value()).__name__ == "LoRA"
    saved = jmem.load(str(tmp_path / "merged")).model
    jax.tree.map(np.testing.assert_array_equal, _params(saved), _params(merge(trained)))


@pytest.mark.parametrize("extra, expected", [
    (dict(lora_rank=4, save="a.npz"), "--save 'a.npz' exists"),
    (dict(lora_rank=4, save="a.np"), "--save 'a.np' with --lora-rank; accepted: a path ending in .npz"),
    (dict(save="taken"), "--save 'taken' is a non-empty directory"),
    # A file name without --lora-rank would have become a model directory of that name.
    (dict(save="out.npz"), "--save 'out.npz' names a .npz file, but without --lora-rank the trained model is saved "
                           "as a directory; accepted: a directory name without .npz"),
    (dict(save="model.safetensors"), "--save 'model.safetensors' names a .safetensors file"),
    (dict(lora_rank=4, save="taken"), "--save 'taken' is a non-empty directory"),
])
def test_bad_save_paths_are_refused_before_training(extra, expected, tmp_path, monkeypatch):
    from jmem.train.checks import validate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "f").write_text("x")
    (tmp_path / "a.npz").write_text("x")
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        validate(TrainConfig(**{**BASE, **extra}))


def test_a_saved_model_trains_on_and_converts_to_gguf_with_its_sources_fields(tmp_path, capsys):
    """--model DIR continues from a --save directory's weights; the directory keeps the source GGUF's general.*
    fields (its license, ...) into `jmem quantize --method bf16`'s file. A directory of quantized weights trains
    adapters only."""
    import gguf

    from jmem.cli import main
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf

    lm = jmem.load("tiny")
    general = {"general.name": "Tiny", "general.license": "apache-2.0", "general.languages": ["en"]}
    write_gguf(tmp_path / "src.gguf", lm.config, lm.model, tokenizer_metadata=byte_tokenizer_metadata(),
               general_metadata=general)
    first = TrainConfig(**{**BASE, "model": str(tmp_path / "src.gguf"), "steps": 1}, save=str(tmp_path / "a"))
    # The source read once, when the run starts: gone by the time it saves, it re-read nothing (it was read again,
    # and the trained model was lost).
    train(first, out=io.StringIO(), on_step=lambda rec: (tmp_path / "src.gguf").unlink())
    assert jmem.load(str(tmp_path / "a")).source.metadata == general
    main(["info", str(tmp_path / "a")])
    printed = capsys.readouterr().out
    assert "quantization:  none (float weights)" in printed and "source:        Tiny (license: apache-2.0)" in printed
    main(["quantize", "--model", str(tmp_path / "a"), "--method", "bf16", "--out", str(tmp_path / "a.gguf")])
    fields = gguf.GGUFReader(tmp_path / "a.gguf").fields
    assert {k: fields[k].contents() for k in general} == general

    second = build(TrainConfig(**{**BASE, "model": str(tmp_path / "a")}))
    jax.tree.map(np.testing.assert_array_equal, _params(second.model), _params(jmem.load(str(tmp_path / "a")).model))
    main(["quantize", "--model", str(tmp_path / "a"), "--method", "int8", "--out", str(tmp_path / "q")])
    capsys.readouterr()
    with pytest.raises(ValueError, match="its weights are quantized .* accepted: --lora-rank R"):
        build(TrainConfig(**{**BASE, "model": str(tmp_path / "q")}))
    qlora = build(TrainConfig(**{**BASE, "model": str(tmp_path / "q")}, lora_rank=2))
    assert type(qlora.model.layers.wq.kernel.get_value()).__name__ == "LoRA"
