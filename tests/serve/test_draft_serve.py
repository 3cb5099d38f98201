"""Draft-model speculative decoding in the serving engine: the target's greedy tokens under chunked prefill,
preemption and prefix hits; a draft equal to the target has every proposal kept (its paged cache follows the
target's exactly); the memory budget counts the draft; bad drafts are refused with one clear error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.distill import student_from_teacher
from jmem.generate import generate_ids
from jmem.io.tokenizer import ByteTokenizer
from jmem.memory import bytes_per_device
from jmem.models import Llama, LlamaConfig
from jmem.serve.engine import Engine, EngineConfig
from jmem.serve.paged_cache import kv_bytes_per_token
from jmem.serve.request import SamplingParams
from tests.helpers import free_port

K = 3
# Pool of 12 blocks of 8 tokens: too small for every request at once (preemption); a 16-token budget
# splits the longer prompts over several steps (chunked prefill).
SMALL = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_blocks=12)


@pytest.fixture(scope="module")
def target():
    return Llama(LlamaConfig.tiny(n_layers=4), rngs=nnx.Rngs(0))


def prompts(seed, n):
    rng = np.random.default_rng(seed)
    shared = [int(x) for x in rng.integers(0, 256, size=16)]  # two full blocks: prefix-cache hits
    out = [[int(x) for x in rng.integers(0, 256, size=rng.integers(1, 30))] for _ in range(n)]
    return out + [shared + [1, 2], shared + [3]]


def greedy(max_tokens=14):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)


def reference(target, ps, max_tokens):
    """Each prompt's greedy tokens and their log-probabilities without the engine: `generate_ids`'
    contiguous cache, then one full forward over prompt + tokens."""
    ids = generate_ids(target, ps, max_tokens)
    seqs = [list(p) + list(r) for p, r in zip(ps, ids)]
    batch = np.zeros((len(seqs), -(-max(map(len, seqs)) // 16) * 16), np.int32)
    for i, seq in enumerate(seqs):
        batch[i, :len(seq)] = seq  # causal: the padding after a row changes none of its logits
    lp = np.asarray(jax.nn.log_softmax(target(jnp.asarray(batch))[0].astype(jnp.float32), axis=-1))
    return [(list(r), [float(lp[i, len(p) - 1 + j, t]) for j, t in enumerate(r)])
            for i, (p, r) in enumerate(zip(ps, ids))]


def test_layer_dropped_draft_gives_the_targets_greedy_tokens(target):
    ps = prompts(0, 6)
    want = reference(target, ps, 14)
    draft = student_from_teacher(target, [0, 1, 2])
    engine = Engine(target, ByteTokenizer(), EngineConfig(num_speculative_tokens=K, **SMALL), draft_model=draft)
    got = engine.generate(ps, greedy())
    runners = (engine.runner, engine.drafter.runner)
    for (tokens, lps), g in zip(want, got, strict=True):
        assert g.token_ids == tokens and g.finish_reason == "length"
        np.testing.assert_allclose([lp for lp, _ in g.logprobs], lps, atol=1e-4)
    m = engine.metrics()
    assert m["step_compilations"] == sum(r.num_compilations for r in runners) > engine.runner.num_compilations
    assert 0 < m["spec_decode_num_accepted_tokens_total"] < m["spec_decode_num_draft_tokens_total"]
    assert m["preemptions_total"] > 0 and m["prefix_cache_hit_tokens_total"] > 0
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks and not engine.kv.req_blocks
    assert not engine.drafter.num_computed  # finished requests forgotten


def test_draft_equal_to_the_target_has_every_proposal_kept(target):
    """The draft's cache holds exactly the target's tokens at every step (catching up on the last proposal
    after a fully kept round, restarting after preemption): its proposals are the target's argmax."""
    ps = prompts(1, 6)[:6]  # no shared prefix: a prefix hit is trusted to hold the draft's K/V as well
    want = [tokens for tokens, _ in reference(target, ps, 20)]
    copy = nnx.merge(*nnx.split(target))
    engine = Engine(target, ByteTokenizer(), EngineConfig(num_speculative_tokens=K, **SMALL), draft_model=copy)
    got = engine.generate(ps, greedy(20))
    assert [g.token_ids for g in got] == want
    m = engine.metrics()
    assert m["preemptions_total"] > 0
    assert m["spec_decode_num_draft_tokens_total"] > 0
    assert m["spec_decode_num_accepted_tokens_total"] == m["spec_decode_num_draft_tokens_total"]


def test_a_prefix_hit_skips_the_drafts_cached_tokens_too(target):
    """A new request whose prompt hits the prefix cache fed its whole prompt to the draft again: a draft step
    larger than the token budget (and than any precompiled shape). The draft starts after the cached blocks
    as the target does, and its K/V there is valid: a draft equal to the target has every proposal kept."""
    copy = nnx.merge(*nnx.split(target))
    engine = Engine(target, ByteTokenizer(), EngineConfig(num_speculative_tokens=K, **SMALL), draft_model=copy)
    shared = prompts(4, 0)
    engine.generate(shared[:1], greedy(4))
    fed = []
    step = engine.drafter.runner.step
    engine.drafter.runner.step = lambda out: fed.append([(s.start, s.num_tokens) for s in out.seqs]) or step(out)
    got = engine.generate(shared[1:], greedy(12))[0]
    assert got.num_cached_tokens == 16 and fed[0] == [(16, len(shared[1]) - 16)]
    assert got.token_ids == reference(target, shared[1:], 12)[0][0]
    m = engine.metrics()
    assert m["spec_decode_num_accepted_tokens_total"] == m["spec_decode_num_draft_tokens_total"] > 0


def test_sampled_requests_with_a_draft_are_seeded(target):
    ps = prompts(2, 3)
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True) for i in range(5)]
    cfg = EngineConfig(num_speculative_tokens=K, **SMALL)
    engines = [Engine(target, ByteTokenizer(), cfg, draft_model=student_from_teacher(target, [0, 1, 2]))
               for _ in range(2)]
    runs = [e.generate(ps, params) for e in engines]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(len(o.token_ids) == 12 for o in runs[0])
    assert all(e.metrics()["spec_decode_num_draft_tokens_total"] > 0 for e in engines)


def test_the_budget_counts_the_draft(target):
    """Weights and KV blocks of both models share the budget: a block costs the target's and the draft's K/V."""
    budget = 1 << 20
    draft = student_from_teacher(target, [0])
    alone = Engine(target, ByteTokenizer(), EngineConfig(kv_cache_memory=budget, block_size=8))
    both = Engine(target, ByteTokenizer(), EngineConfig(kv_cache_memory=budget, block_size=8,
                                                       num_speculative_tokens=2), draft_model=draft)
    per_token = [kv_bytes_per_token(m.config, "auto", 8) for m in (target, draft)]
    assert per_token[0] == 4 * per_token[1]  # K/V bytes follow the layers: 4 for the target, 1 for the draft
    assert alone.kv.pool.num_blocks + 1 == budget // (per_token[0] * 8)  # one spare page
    assert both.kv.pool.num_blocks + 1 == budget // (sum(per_token) * 8)
    assert both.weight_bytes == alone.weight_bytes + bytes_per_device(nnx.state(draft))


@pytest.mark.parametrize("make, kwargs, msg", [
    (lambda t: Llama(LlamaConfig.tiny(vocab_size=300), rngs=nnx.Rngs(1)), {},
     "the draft model's vocab_size=300 differs from the target's 259"),
    (lambda t: Llama(LlamaConfig.tiny(max_seq_len=32), rngs=nnx.Rngs(1)), {},
     "the draft model's context of 32 tokens is shorter than max_model_len=64"),
    (lambda t: student_from_teacher(t, [0]), dict(num_speculative_tokens=0),
     "num_speculative_tokens=0; accepted: >= 1 with a draft model"),
])
def test_bad_drafts_are_refused(target, make, kwargs, msg):
    cfg = EngineConfig(**{**SMALL, "num_speculative_tokens": K, **kwargs})
    with pytest.raises(ValueError, match=msg):
        Engine(target, ByteTokenizer(), cfg, draft_model=make(target))


def test_serve_flags_build_a_drafting_engine(capsys):
    from jmem.serve.cli import ServeArgs, build_engine, serve_main

    args = ServeArgs(model="tiny", num_speculative_tokens=2, speculative_layers=(1,), num_blocks=16,
                     max_model_len=64, warmup=False)
    engine, _ = build_engine(args)
    assert engine.drafter.runner.config.n_layers == 1
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and engine.metrics()["spec_decode_num_draft_tokens_total"] > 0
    for flags, msg in [
        (["--speculative-layers", "0"], "--num-speculative-tokens=0; accepted: >= 1 with a draft model"),
        (["--num-speculative-tokens", "2", "--speculative-layers", "5"],
         "--speculative-layers: layer 5 is out of range for a teacher of 2 layers"),
        (["--num-speculative-tokens", "2", "--speculative-layers", "0", "--speculative-model", "tiny"],
         "--speculative-model='tiny' and --speculative-layers=[0] both given; accepted: one of them"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            serve_main(["--model", "tiny", "--port", str(free_port()), "--num-blocks", "16", *flags])
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"jmem serve: error: {msg}"), lines


def test_a_missing_model_or_draft_is_refused_before_anything_loads(monkeypatch, capsys):
    import jmem
    from jmem.serve.cli import serve_main

    def refuse_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(jmem, "load", refuse_load)
    for flags, msg in [
        (["--model", "/missing/t.gguf"], "--model '/missing/t.gguf' is neither a file nor a directory nor a known "
                                         "name; accepted: a .gguf path"),
        (["--model", "tiny", "--num-speculative-tokens", "2", "--speculative-model", "/missing/d.gguf"],
         "--speculative-model '/missing/d.gguf' is neither a file"),
        # Refused after both models loaded, without naming the flag.
        (["--model", "tiny", "--num-speculative-tokens", "2", "--speculative-model", "bench-8l"],
         "--speculative-model 'bench-8l' has a vocabulary of 8192 tokens, --model 'tiny' one of 259; accepted: "),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            serve_main(["--port", str(free_port()), "--num-blocks", "16", *flags])
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"jmem serve: error: {msg}"), lines


def test_a_draft_file_with_other_tokens_is_refused(tmp_path, capsys):
    """Same vocabulary size, two tokens swapped: one line naming the flag and the first difference."""
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.serve.cli import serve_main
    from tests.helpers import random_model

    cfg = LlamaConfig.tiny(n_layers=1)
    meta = byte_tokenizer_metadata()
    swapped = list(meta["tokenizer.ggml.tokens"])
    swapped[97], swapped[98] = swapped[98], swapped[97]
    for name, tokens in (("t.gguf", meta["tokenizer.ggml.tokens"]), ("d.gguf", swapped)):
        write_gguf(tmp_path / name, cfg, random_model(cfg, 0),
                   tokenizer_metadata={**meta, "tokenizer.ggml.tokens": tokens})
    draft = str(tmp_path / "d.gguf")
    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--model", str(tmp_path / "t.gguf"), "--port", str(free_port()), "--num-blocks", "16",
                    "--num-speculative-tokens", "2", "--speculative-model", draft])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"jmem serve: error: --speculative-model {draft!r}'s token 97 is 'b', the model's 'a'; "
                     "accepted: a draft with the model's tokenizer"], lines


@pytest.mark.slow
def test_precompiled_drafting_engine_never_waits_for_a_compilation(target):
    engine = Engine(target, ByteTokenizer(), EngineConfig(num_speculative_tokens=K, **SMALL),
                    draft_model=student_from_teacher(target, [0, 1, 2]))
    engine.precompile()  # both models' largest steps: then no step of either waits for a compilation
    got = engine.generate(prompts(0, 6), greedy())
    assert [g.token_ids for g in got] == [tokens for tokens, _ in reference(target, prompts(0, 6), 14)]
    for runner in (engine.runner, engine.drafter.runner):
        runner.finish_compilations()
        assert runner.num_blocking_compilations == 0


@pytest.mark.slow
def test_tensor_parallel_target_and_draft(target):
    """Both models split over two devices (each device holds its kv heads of both caches' blocks)."""
    ps = prompts(3, 3)
    want = [tokens for tokens, _ in reference(target, ps, 10)]
    cfg = EngineConfig(num_speculative_tokens=K, tensor_parallel_size=2, **SMALL)
    engine = Engine(target, ByteTokenizer(), cfg, draft_model=student_from_teacher(target, [0, 1, 2]))
    got = engine.generate(ps, greedy(10))
    assert [g.token_ids for g in got] == want
    assert engine.metrics()["spec_decode_num_accepted_tokens_total"] > 0
    assert engine.drafter.runner.cache.mesh is engine.runner.cache.mesh
