"""Block pool, KV-cache manager and scheduler invariants (pure Python, no model)."""

import random
import re

import numpy as np
import pytest

from jmem.serve.block_pool import BlockPool, NoFreeBlocksError, hash_block
from jmem.serve.kv_cache import KVCacheManager
from jmem.serve.request import ContextTooLong, Request, RequestError, SamplingParams, Status
from jmem.serve.scheduler import Scheduler, SchedulerConfig


def fake_model(tokens):
    """A deterministic 'model': next token from the whole history (what a real LM does)."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 2654435761) % 1000 + 10


def check_pool(pool: BlockPool):
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    assert len(set(pool._free)) == pool.num_free
    for b in pool.blocks:
        assert (b.ref_cnt == 0) == (b.block_id in pool._free)


def run_to_completion(sched: Scheduler, max_steps=100_000):
    """Drive the scheduler with the fake model; check invariants every step."""
    done = {}
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_tokens <= sched.config.max_num_batched_tokens
        assert len(out.seqs) <= sched.config.max_num_seqs
        assert out.seqs or out.preempted, "scheduler made no progress"
        sampled = {}
        for seq in out.seqs:
            req = seq.request
            # The block list covers every token computed so far, and no more than one spare block.
            end = seq.start + seq.num_tokens
            assert len(seq.block_ids) * sched.kv.block_size >= end
            assert len(seq.block_ids) == -(-end // sched.kv.block_size)
            if seq.samples:
                sampled[req.request_id] = fake_model(req.all_token_ids)
        for req in sched.update_from_output(out, sampled):
            if req.status.finished:
                done[req.request_id] = req
        check_pool(sched.kv.pool)
        steps += 1
        assert steps < max_steps
    return done


def expected_output(prompt, params: SamplingParams, eos=()):
    toks, out = list(prompt), []
    while True:
        t = fake_model(toks)
        toks.append(t)
        out.append(t)
        if t in eos or t in params.stop_token_ids or len(out) >= params.max_tokens:
            return out


def test_pool_refcounts_and_lru():
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.cache_block(a[0], hash_block(None, [1, 2]))
    pool.cache_block(b[0], hash_block(None, [3, 4]))
    pool.free(reversed(a))
    pool.free(reversed(b))
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="not in use"):
        pool.free([a[0]])
    # Unhashed blocks are evicted before cached ones; cached ones in the order they were freed.
    got = pool.allocate(3)
    assert set(got[:2]) == {a[1], b[1]} and got[2] == a[0]
    assert pool.lookup(hash_block(None, [1, 2])) is None
    assert pool.lookup(hash_block(None, [3, 4])) == b[0]
    pool.touch([b[0]])
    assert pool.blocks[b[0]].ref_cnt == 1 and pool.num_free == 0
    check_pool(pool)


def test_hash_chains_on_parent_and_adapter():
    h = hash_block(None, [1, 2, 3])
    assert hash_block(h, [4]) != hash_block(None, [4])
    assert hash_block(None, [1, 2, 3], "lora-a") != h
    assert hash_block(None, [1, 2, 3]) == h
    assert hash_block(None, [1, 2, 3], "") != h  # the base model is not an adapter named ""


@pytest.mark.parametrize("call, bad", [("free", -1), ("free", 4), ("touch", -1), ("cache_block", 7),
                                       ("allocate", -2), ("allocate", 1.5), ("init", True), ("init", 2.5)])
def test_pool_rejects_bad_ids_and_counts(call, bad):
    """-1 (a block table's empty slot) must not free the last block as a Python index would."""
    pool = BlockPool(4)
    held = pool.allocate(4)
    with pytest.raises(ValueError, match=repr(bad)):
        if call == "init":
            BlockPool(bad)
        elif call == "allocate":
            pool.allocate(bad)
        elif call == "cache_block":
            pool.cache_block(bad, b"h")
        else:
            getattr(pool, call)([bad])
    assert [pool.blocks[b].ref_cnt for b in held] == [1, 1, 1, 1] and pool.num_free == 0


def test_stale_prefix_hits_refused():
    """Hits looked up before another allocation evicted them would read that request's KV."""
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    kv.commit_written()
    kv.free(a)
    b = Request("b", [1, 2, 3, 4, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    c = Request("c", list(range(100, 114)))
    kv.allocate_slots(c, 14)  # takes every free block, a's cached ones included
    kv.free(c)
    b.num_computed_tokens = n
    with pytest.raises(ValueError, match="no longer holds its prefix"):
        kv.allocate_slots(b, 1, hits)
    assert kv.pool.num_free == 8
    with pytest.raises(ValueError, match="-5"):
        kv.allocate_slots(b, -5)


def test_prefix_hits_shared_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    prefix = list(range(100, 112))  # 3 full blocks
    sched.add_request(Request("a", prefix + [1, 2], SamplingParams(max_tokens=3)))
    done = run_to_completion(sched)
    assert kv.prefix_hits == 0
    sched.add_request(Request("b", prefix + [7], SamplingParams(max_tokens=3)))
    sched.add_request(Request("c", prefix + [8, 9], SamplingParams(max_tokens=3)))
    out = sched.schedule()
    b, c = (s for s in out.seqs)
    assert b.request.num_cached_tokens == 12 and c.request.num_cached_tokens == 12
    assert b.block_ids[:3] == c.block_ids[:3]
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in b.block_ids[:3])
    assert b.start == 12 and b.num_tokens == 1
    sched.update_from_output(out, {"b": 5, "c": 5})
    done.update(run_to_completion(sched))
    assert kv.prefix_hits == 24 and kv.prefix_queries == 14 + 13 + 14
    assert kv.pool.num_used == 0


def test_blocks_become_hits_after_the_step_that_writes_them():
    """A block is a prefix hit only once the step that writes it has run; a request whose next prefix
    block the step being scheduled writes waits one step and then shares it."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    prefix = list(range(100, 108))  # 2 full blocks
    sched.add_request(Request("a", prefix + [1], SamplingParams(max_tokens=3)))
    sched.add_request(Request("b", prefix + [2], SamplingParams(max_tokens=3)))
    sched.add_request(Request("e", [60, 61], SamplingParams(max_tokens=3)))
    out = sched.schedule()
    assert [s.request.request_id for s in out.seqs] == ["a"]  # b waits for a's blocks; e keeps FCFS order
    a = out.seqs[0]
    assert kv.pool.lookup(kv.req_hashes["a"][0]) is None  # not written yet
    sched.update_from_output(out, {"a": 5})
    out = sched.schedule()
    b = next(s for s in out.seqs if s.request.request_id == "b")
    assert b.start == 8 and b.block_ids[:2] == a.block_ids[:2] and b.request.num_cached_tokens == 8
    assert "e" in [s.request.request_id for s in out.seqs]
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.seqs if s.samples})
    # A request that leaves its blocks before the step ran never makes them hits.
    sched.add_request(Request("d", [50, 51, 52, 53, 54], SamplingParams(max_tokens=3)))
    out = sched.schedule()
    d = next(s for s in out.seqs if s.request.request_id == "d")
    sched.finish("d")
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.seqs if s.samples})
    assert kv.pool.lookup(hash_block(None, [50, 51, 52, 53])) is None and d.block_ids
    # Static batches form at once: a shared prefix does not hold a request out of the batch.
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                      static_batching=True), kv)
    for rid in "ab":
        sched.add_request(Request(rid, prefix + [1], SamplingParams(max_tokens=3)))
    assert len(sched.schedule().seqs) == 2


def test_full_prompt_hit_still_computes_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(max_model_len=32), kv)
    prompt = list(range(8))
    for rid in ("a", "b"):
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=2)))
        run_to_completion(sched)
    assert kv.prefix_hits == 4  # one block of two: the last token must be recomputed


@pytest.mark.parametrize("chunked", [True, False])
def test_small_pool_loses_nothing(chunked):
    """Many requests on a pool far too small for all: each finishes with exactly its own output."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=10, block_size=4)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16 if chunked else 40, max_model_len=40, chunked_prefill=chunked)
    sched = Scheduler(cfg, kv)
    eos = (13, 57)
    reqs = {}
    for i in range(60):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 15))]
        params = SamplingParams(max_tokens=rng.randrange(1, 40 - len(prompt) + 1))
        reqs[str(i)] = (prompt, params)
        sched.add_request(Request(str(i), prompt, params, eos_token_ids=eos))
    done = run_to_completion(sched)
    assert set(done) == set(reqs)
    for rid, (prompt, params) in reqs.items():
        assert done[rid].output_token_ids == expected_output(prompt, params, eos), rid
    assert sched.num_preemptions > 0, "pool was meant to be too small: preemption untested"
    # Prefix-cache figures describe first admissions: a recompute's lookup (mostly its own blocks) is not one.
    assert all(r.num_cached_tokens <= len(reqs[rid][0]) for rid, r in done.items())
    assert kv.prefix_queries == sum(len(p) for p, _ in reqs.values())
    assert kv.pool.num_used == 0 and not kv.req_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_lora_slot_limit_holds_every_step_and_starves_no_adapter():
    """max_loras=2 with requests of adapters a, b, c and the base: no step runs more than two adapters, every
    request gets its own output, and c (behind a steady stream of a and b) is admitted while they still arrive."""
    rng = random.Random(1)
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=40, max_loras=2), kv)
    reqs, c_admitted_at, step, finished = {}, None, 0, 0

    def add(rid, adapter):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 8))]
        params = SamplingParams(max_tokens=rng.randrange(4, 12))
        reqs[rid] = (prompt, params)
        sched.add_request(Request(rid, prompt, params, adapter_id=adapter))

    for i in range(4):
        add(f"a{i}", "a"), add(f"b{i}", "b")
    add("c", "c"), add("base", None)
    while sched.has_unfinished():
        if step < 100:  # a and b keep coming while c waits
            add(f"a-late{step}", "a"), add(f"b-late{step}", "b")
        out = sched.schedule()
        assert len({s.request.adapter_id for s in out.seqs} - {None}) <= 2
        assert len({r.adapter_id for r in sched.running} - {None}) <= 2
        if c_admitted_at is None and any(s.request.request_id == "c" for s in out.seqs):
            c_admitted_at = step
        sampled = {s.request.request_id: fake_model(s.request.all_token_ids) for s in out.seqs if s.samples}
        for req in sched.update_from_output(out, sampled):
            if req.status.finished:
                assert req.output_token_ids == expected_output(*reqs[req.request_id]), req.request_id
                finished += 1
        step += 1
        assert step < 1000
    assert c_admitted_at is not None and c_admitted_at < 30, c_admitted_at
    assert finished == len(reqs) and kv.pool.num_used == 0 and not sched.requests
    with pytest.raises(ValueError, match="max_loras=0; need >= 1"):
        Scheduler(SchedulerConfig(max_loras=0), kv)


def test_interleaved_adapters_still_batch_with_one_slot():
    """Requests of a, b, a, b, ... arriving together with one adapter slot: each adapter's requests run
    together (as many steps as when they arrive grouped), not one request at a time."""
    def steps(order):
        kv = KVCacheManager(num_blocks=64, block_size=4)
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=40, max_loras=1),
                          kv)
        for i, adapter in enumerate(order):
            sched.add_request(Request(str(i), [i + 1, 2, 3], SamplingParams(max_tokens=8), adapter_id=adapter))
        n, widest = 0, 0
        while sched.has_unfinished():
            out = sched.schedule()
            assert len({s.request.adapter_id for s in out.seqs}) == 1
            widest = max(widest, len(out.seqs))
            sched.update_from_output(out, {s.request.request_id: 7 for s in out.seqs if s.samples})
            n += 1
        return n, widest

    grouped, interleaved = steps("aaaabbbb"), steps("abababab")
    assert interleaved == grouped and grouped[1] == 4, (interleaved, grouped)


def test_decodes_first_then_chunked_prefill():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64), kv)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10)))
    out = sched.schedule()
    sched.update_from_output(out, {"a": 4})
    sched.add_request(Request("b", list(range(20)), SamplingParams(max_tokens=10)))
    out = sched.schedule()
    assert [(s.request.request_id, s.start, s.num_tokens) for s in out.seqs] == [("a", 3, 1), ("b", 0, 7)]
    assert not out.seqs[1].samples
    sched.update_from_output(out, {"a": 5})
    out = sched.schedule()
    assert [(s.request.request_id, s.start, s.num_tokens) for s in out.seqs] == [("a", 4, 1), ("b", 7, 7)]


def test_abort_frees_blocks_and_errors():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(max_model_len=32), kv)
    sched.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=5)))
    sched.add_request(Request("b", list(range(10)), SamplingParams(max_tokens=5)))
    sched.schedule()
    assert kv.pool.num_used > 0
    assert sched.finish("a").status is Status.FINISHED_ABORTED
    assert sched.finish("b").status is Status.FINISHED_ABORTED
    assert sched.finish("b") is None
    assert kv.pool.num_used == 0 and not sched.has_unfinished()
    with pytest.raises(ContextTooLong, match="exceeds the maximum context of 32") as e:
        sched.add_request(Request("c", list(range(30)), SamplingParams(max_tokens=5)))
    # The prompt leaves room for 2 tokens: the output length is at fault; a prompt that fills the context is.
    assert e.value.param == "max_tokens" and (e.value.prompt_tokens, e.value.max_tokens, e.value.limit) == (30, 5, 32)
    with pytest.raises(ContextTooLong) as full:
        sched.add_request(Request("c", list(range(32)), SamplingParams(max_tokens=1)))
    assert full.value.param == "prompt"
    assert e.value.describe("max_completion_tokens").startswith("prompt (30 tokens) + max_completion_tokens (5) = 35")
    with pytest.raises(RequestError, match="empty") as e:
        sched.add_request(Request("d", []))
    assert e.value.param == "prompt"


def test_sampling_params_validation():
    SamplingParams().validate()
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.array(0.9), max_tokens=np.array(4), seed=np.int64(7))
    p.validate()  # 0-d array numbers become Python numbers
    assert (type(p.temperature), type(p.top_p), p.max_tokens, type(p.max_tokens), p.seed) == (float, float, 4, int, 7)
    for bad in (dict(max_tokens=0), dict(temperature=-0.1), dict(temperature=2.5), dict(top_p=0.0), dict(min_p=2),
                dict(logprobs=21), dict(top_k=-2), dict(top_k=2**31),  # top_k: an int32 on the device
                dict(seed=2**63), dict(seed=-(2**63) - 1)):  # seed: 64 bits
        with pytest.raises(RequestError, match=next(iter(bad))) as e:
            SamplingParams(**bad).validate()
        assert e.value.param == next(iter(bad))
    for ids in (5, "12", [1, 2.0]):  # a TypeError for 5; "12" was read as ['1', '2']
        with pytest.raises(RequestError, match=rf"^stop_token_ids={re.escape(repr(ids))}; accepted: a list of integer"):
            SamplingParams(stop_token_ids=ids).validate()
    p = SamplingParams(stop_token_ids=(3, np.int64(4)))
    p.validate()
    assert p.stop_token_ids == [3, 4]
