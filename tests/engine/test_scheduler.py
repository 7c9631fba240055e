"""Scheduler + KV-cache manager without a model: random add / step / abort / finish sequences
never leak or double-free a block, and every block is free at the end."""

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.config import EngineConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def _step(sched: Scheduler) -> tuple:
    """One fake step: the 'model' samples token = position % 7 for requests that need one."""
    out = sched.schedule()
    sampled = {
        s.request_id: (s.start_position + len(s.token_ids)) % 7 for s in out.scheduled if s.needs_sample
    }
    _check_writes_are_exclusive(sched, out)
    updated = sched.update_from_output(out, sampled)
    for req in updated:
        if req.num_output_tokens >= req.params.max_tokens:
            sched.finish_request(req.request_id, "length")
    return out, updated


def _check_writes_are_exclusive(sched: Scheduler, out) -> None:
    """A step writes K/V only into blocks its request owns alone, never into a shared block."""
    bs = sched.config.block_size
    total = 0
    for s in out.scheduled:
        total += len(s.token_ids)
        end = s.start_position + len(s.token_ids)
        assert len(s.block_ids) * bs >= end, "block table too short for the scheduled tokens"
        for pos in range(s.start_position, end):
            block = sched.kv.pool.blocks[s.block_ids[pos // bs]]
            assert block.ref_count == 1, f"write into shared block {block}"
    assert total <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs


def _make(num_blocks=6, block_size=4, budget=16, max_seqs=4, **kw) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs, **kw)
    return Scheduler(cfg, num_blocks)


def test_decode_after_prefill_and_chunking():
    sched = _make(num_blocks=10, budget=8)
    sched.add_request(Request("a", list(range(20)), SamplingParams(max_tokens=3), arrival_index=1))
    chunks = []
    while sched.has_unfinished():
        out, _ = _step(sched)
        chunks.append([(s.start_position, len(s.token_ids), s.needs_sample) for s in out.scheduled])
    assert chunks == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)], [(20, 1, True)], [(21, 1, True)]]
    assert sched.kv.num_free_blocks == 10


def test_no_chunked_prefill_waits_for_budget():
    sched = _make(num_blocks=10, budget=8, enable_chunked_prefill=False)
    sched.add_request(Request("a", list(range(6)), SamplingParams(max_tokens=2), arrival_index=1))
    sched.add_request(Request("b", list(range(10, 16)), SamplingParams(max_tokens=2), arrival_index=2))
    out, _ = _step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]  # b (6 tokens) does not fit in 8 - 6
    out, _ = _step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 6)]


def test_preempts_least_urgent_latest_when_blocks_run_out():
    sched = _make(num_blocks=4, block_size=4, budget=64, enable_prefix_caching=False)
    sched.add_request(Request("a", list(range(7)), SamplingParams(max_tokens=9), priority=1, arrival_index=1))
    sched.add_request(Request("b", list(range(7)), SamplingParams(max_tokens=9), priority=1, arrival_index=2))
    preempted = []
    while sched.has_unfinished():
        out, _ = _step(sched)
        preempted += out.preempted_request_ids
    assert preempted and set(preempted) == {"b"}
    assert sched.kv.num_free_blocks == 4


def test_urgent_waiting_request_preempts_bulk_work():
    sched = _make(num_blocks=6, block_size=4, budget=64, max_seqs=2)
    for i in range(2):
        prompt = list(range(8 * i, 8 * i + 8))  # distinct: nothing to wait for in the cache
        sched.add_request(Request(f"low{i}", prompt, SamplingParams(max_tokens=12), priority=3, arrival_index=i))
    _step(sched)
    assert {r.request_id for r in sched.running} == {"low0", "low1"}
    sched.add_request(Request("urgent", [5] * 8, SamplingParams(max_tokens=2), priority=0, arrival_index=9))
    out, _ = _step(sched)
    assert "urgent" in [s.request_id for s in out.scheduled]
    assert out.preempted_request_ids == ["low1"]
    # Equal priority never preempts: the preempted request waits for a slot instead.
    while sched.has_unfinished():
        _step(sched)
    assert sched.kv.num_free_blocks == 6


def test_prefix_cache_hit_skips_computed_tokens():
    sched = _make(num_blocks=12, block_size=4, budget=64)
    sys_prompt = list(range(100, 112))  # 3 full blocks
    sched.add_request(Request("a", sys_prompt + [1, 2], SamplingParams(max_tokens=1), arrival_index=1))
    while sched.has_unfinished():
        _step(sched)
    sched.add_request(Request("b", sys_prompt + [3, 4], SamplingParams(max_tokens=1), arrival_index=2))
    out, _ = _step(sched)
    (s,) = out.scheduled
    assert (s.start_position, s.token_ids) == (12, [3, 4])
    assert sched.num_prefix_hits == 12 and sched.num_tokens_reused == 12


def test_requests_sharing_a_prefix_admitted_together_compute_it_once():
    """Chat prompts that share a system prompt arrive together: the first computes the shared
    blocks, the others (a long prompt that shares only the first block too) wait one step and
    take them from the prefix cache; a request behind the waiting ones, with a prompt of its
    own, is admitted in the first step."""
    sched = _make(num_blocks=64, block_size=4, budget=256, max_seqs=8)
    sys_prompt = list(range(100, 112))  # 3 full blocks
    for i in range(3):
        prompt = sys_prompt + [i, i + 1, i + 2]
        sched.add_request(Request(f"chat{i}", prompt, SamplingParams(max_tokens=2), arrival_index=i))
    long_prompt = sys_prompt[:4] + list(range(300, 340))  # shares the first block
    sched.add_request(Request("long", long_prompt, SamplingParams(max_tokens=2), arrival_index=3))
    sched.add_request(Request("other", list(range(200, 215)), SamplingParams(max_tokens=2), arrival_index=4))
    out, _ = _step(sched)
    assert [s.request_id for s in out.scheduled] == ["chat0", "other"]
    assert all(s.start_position == 0 for s in out.scheduled)
    out, _ = _step(sched)
    later = {s.request_id: s for s in out.scheduled}
    assert {"chat1", "chat2", "long"} <= set(later)
    for rid in ("chat1", "chat2"):
        assert (later[rid].start_position, len(later[rid].token_ids)) == (12, 3)  # cached: 12
    assert (later["long"].start_position, len(later["long"].token_ids)) == (4, 40)
    assert sched.num_prefix_hits == 28 and sched.num_tokens_reused == 28
    while sched.has_unfinished():
        _step(sched)
    assert sched.kv.num_free_blocks == 64


def test_requests_that_cannot_take_cached_blocks_do_not_wait_for_them():
    """Nothing can be taken from a cache that is off, nor by a request that wants its prompt's
    logprobs (cached tokens would have none): such requests sharing a prefix are admitted
    together."""
    for caching, params in ((False, SamplingParams(max_tokens=2)),
                            (True, SamplingParams(max_tokens=2, prompt_logprobs=1))):  # fmt: skip
        sched = _make(num_blocks=64, block_size=4, budget=256, max_seqs=8,
                      enable_prefix_caching=caching)  # fmt: skip
        for i in range(3):
            sched.add_request(Request(f"chat{i}", list(range(100, 112)) + [i], params, arrival_index=i))
        out, _ = _step(sched)
        assert [s.request_id for s in out.scheduled] == ["chat0", "chat1", "chat2"], caching


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 12),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(4, 24),
        max_seqs=st.integers(1, 4),
        caching=st.booleans(),
        chunked=st.booleans(),
    )
    def init(self, num_blocks, block_size, budget, max_seqs, caching, chunked):
        self.sched = _make(num_blocks, block_size, budget, max_seqs,
                           enable_prefix_caching=caching, enable_chunked_prefill=chunked)
        self.n = 0
        self.live: set[str] = set()

    @rule(
        prompt=st.lists(st.integers(0, 3), min_size=1, max_size=12),
        max_tokens=st.integers(1, 6),
        priority=st.integers(0, 2),
    )
    def add(self, prompt, max_tokens, priority):
        cfg = self.sched.config
        if not cfg.enable_chunked_prefill and len(prompt) + max_tokens > cfg.max_num_batched_tokens:
            return  # could never be scheduled whole; the engine's own validation covers this
        if -(-(len(prompt) + max_tokens) // cfg.block_size) > self.sched.kv.num_blocks:
            return  # the engine rejects a request that could never fit the pool
        self.n += 1
        rid = f"r{self.n}"
        self.sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens),
                                       priority=priority, arrival_index=self.n))
        self.live.add(rid)

    @rule()
    def step(self):
        _step(self.sched)
        self.live &= set(self.sched.requests)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.sched.finish_request(rid, "abort") is not None
        self.live.discard(rid)

    @invariant()
    def blocks_consistent(self):
        kv = self.sched.kv
        kv.pool.check_invariants()
        refs = Counter()
        for rid, req in self.sched.requests.items():
            ids = kv.block_ids(rid)
            if req in self.sched.running:
                assert len(ids) * kv.block_size >= req.num_computed_tokens
            else:
                assert ids == [], "a waiting request holds no blocks"
            refs.update(ids)
        for block in kv.pool.blocks:
            assert block.ref_count == refs[block.block_id]

    def teardown(self):
        # Everything still queued runs to completion: no request is stuck forever.
        for _ in range(500):
            if not self.sched.has_unfinished():
                break
            _step(self.sched)
        assert not self.sched.has_unfinished(), self.sched.requests
        assert self.sched.kv.num_free_blocks == self.sched.kv.num_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
