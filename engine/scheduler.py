"""Iteration-level scheduler: who runs this step, with how many tokens. Pure Python.

Policy only. Each step has a token budget (`max_num_batched_tokens`) and a cap on running
requests (`max_num_seqs`). Requests are served most urgent first (lower priority value), then
in arrival order. Every request follows one rule: its computed tokens catch up with its tokens.

Preemption is by recompute: a preempted request drops its blocks (they stay in the prefix
cache until evicted, so resuming is often cheap) and goes back to the waiting queue. It
happens in two cases:
1. a running request needs a block and none is free: the least urgent, latest-arrived
   running request is preempted (possibly the one asking);
2. a waiting request is more urgent than some running request and cannot be admitted for
   lack of blocks or of a running slot: the least urgent running request makes room
   (vLLM v1 admits waiting work only when it fits, so urgent work waits behind bulk work).

Steps sized by urgency: while any request at least as urgent as `config.urgent_priority` is in
the engine and `config.step_time_target_ms` is set, a step also has a time budget. The step
cost model (engine/step_cost.py: tokens and context lengths, calibrated at start-up, corrected
after every step) turns it into tokens per chunk, so a long prefill is split into chunks that
fit and a critical request's first token is never more than about one target away. Urgent
waiting work is then admitted before less urgent running work takes the rest of the step.
With only normal and low work a step's prefill chunks stay under `config.max_step_time_ms`
when that is set (the worker's default; decodes are never cut): the engine takes new requests
only between steps, so the longest step is about the longest an arriving critical request waits
before its own prefill can start. That cap is loose (hundreds of ms: a step's fixed cost stays a
small share of it).

Prompts that share blocks (a system prompt, a chat template) and arrive together: a waiting
request whose next full block a request admitted before it in the same step computes waits one
step and takes it from the prefix cache (`_waits_for_blocks`), so the shared blocks are
computed once.

Samples of one prompt (SamplingParams.n > 1) are requests of their own that share the prompt's
KV blocks through the prefix cache: the first sample (the leader) is queued as any request,
the others are held out of the queue until the leader's prompt is computed (its full blocks
are then in the cache), so the prompt is computed once and each further sample computes only
its last, partial block before it decodes on its own. Holding is the whole mechanism: forking
block tables at the end of prefill would also need n first tokens drawn from one logits row.
Without prefix caching, or with a prompt shorter than a block, nothing could be shared, so
nothing is held.
"""

from __future__ import annotations

import heapq
import math

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request, RequestStatus
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.step_cost import StepCostModel

# Urgent chunks of a capped step together get at least this share of the token budget (each
# all it wants while the share lasts), so urgent work makes progress even when the model says
# the target cannot be met (a machine slower than the target, a calibration taken under load).
# The cap is there to shorten the steps of the work around urgent work, not its own. Measured
# with SmolLM2 on the loaded 2-core machine: a floor of 16 tokens split a critical 80-token
# prompt over 5 steps whose fixed cost dominated (critical TTFT p50 30.5 s against the low
# requests' 18.2 s); a floor for the first chunk only still served 3 critical 64-token prompts
# arriving together one after another, in 1, 3 and 4 steps.
MIN_URGENT_SHARE = 4  # max_num_batched_tokens // this


class StepCap:
    """The time budget of one step, spent chunk by chunk. At least half the target goes to the
    chunks even when the fixed cost alone would use it all (no target is met then; steps stay
    short all the same). Urgent chunks may go past it by up to `min_urgent_tokens` tokens in
    all; the first chunk always gets at least one token. With `keeps_decodes` (the cap without
    urgent work) a one-token chunk, a decode, always goes in and spends nothing: that cap bounds
    the prefill in a step, and a decode batch is bounded by `max_num_seqs` already. Charging
    decodes cut the prefill share of each step as more requests decoded, which spread W2's 32
    prompts over ~20 steps and delayed the last one's start (throughput 0.95x of uncapped)."""

    def __init__(
        self,
        model: StepCostModel,
        target_ms: float,
        min_urgent_tokens: int = 0,
        keeps_decodes: bool = False,
    ) -> None:
        self._model = model
        self.remaining_ms = max(target_ms - model.step_fixed_ms(), target_ms / 2)
        self.urgent_floor = min_urgent_tokens  # left of the urgent chunks' floor
        self.keeps_decodes = keeps_decodes
        self.num_chunks = 0

    def take(self, start: int, num_wanted: int, is_urgent: bool = False) -> int:
        """How many of `num_wanted` tokens at `start` fit; spends their cost."""
        if self.keeps_decodes and num_wanted == 1:
            self.num_chunks += 1
            return 1  # and free: prefill chunks keep the whole budget
        num_new = min(num_wanted, self._model.max_new_tokens(start, self.remaining_ms))
        if is_urgent:
            num_new = max(num_new, min(self.urgent_floor, num_wanted))
        if self.num_chunks == 0:
            num_new = max(num_new, min(1, num_wanted))
        if num_new > 0:
            self.remaining_ms -= self._model.chunk_ms(start, num_new)
            self.num_chunks += 1
            if is_urgent:
                self.urgent_floor = max(0, self.urgent_floor - num_new)
        return num_new


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[
            tuple[tuple[int, int], str]
        ] = []  # heap of (sort_key, id); lazy deletion
        self._finished_ids: list[str] = []
        # leader id -> samples held until the leader's prompt is computed (not in _waiting).
        self._held: dict[str, list[Request]] = {}
        # Set when steps are sized by urgency; the engine replaces it with a calibrated one.
        self.cost_model: StepCostModel | None = StepCostModel() if config.has_step_cost else None
        self._num_urgent = 0  # requests in the engine with priority <= config.urgent_priority
        # Counters for EngineStats.
        self.num_preemptions = 0
        self.num_prefix_queries = 0  # prompt tokens looked up at first admission
        self.num_prefix_hits = 0
        self.num_tokens_computed = 0
        self.num_tokens_reused = 0  # tokens served from the prefix cache, resumes included

    # -- queue management ----------------------------------------------------------------
    def add_request(self, req: Request, leader: Request | None = None) -> None:
        """Queue `req`; a further sample of `leader`'s prompt waits (held) until the leader's
        prompt is computed, so that it finds the prompt's full blocks in the prefix cache."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self.requests[req.request_id] = req
        self._num_urgent += self._is_urgent(req)
        req.status = RequestStatus.WAITING
        if leader is not None and self._can_share_prompt(leader):
            self._held.setdefault(leader.request_id, []).append(req)
            return
        heapq.heappush(self._waiting, (req.sort_key, req.request_id))

    def _can_share_prompt(self, leader: Request) -> bool:
        """Holding pays when the leader's prompt is still to compute and has a full block to
        share (the last token is always computed, so a prefix hit needs block_size + 1)."""
        return (
            self.kv.enable_caching
            and leader.num_prompt_tokens > self.config.block_size
            and not _has_computed_prompt(leader)
        )

    @property
    def num_held(self) -> int:
        return sum(len(held) for held in self._held.values())

    def _release_held(self, leader_id: str) -> None:
        for req in self._held.pop(leader_id, ()):
            heapq.heappush(self._waiting, (req.sort_key, req.request_id))

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish_request(self, request_id: str, reason: str) -> Request | None:
        """Remove a request (finished or aborted) and free its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._num_urgent -= self._is_urgent(req)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        held = self._held.get(req.group_id, ())
        if req in held:  # a held sample leaves before it was ever queued
            held.remove(req)
        self._release_held(request_id)  # a leader that leaves (even unfinished) holds no one
        # A waiting entry stays in the heap and is skipped when popped.
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.forget(req)
        self._finished_ids.append(request_id)
        return req

    def _is_urgent(self, req: Request) -> bool:
        return req.priority <= self.config.urgent_priority

    @property
    def has_urgent(self) -> bool:
        return self._num_urgent > 0

    @property
    def is_urgent_step(self) -> bool:
        """Whether this step is sized by urgency (`step_time_target_ms`, urgent work first)."""
        return self.config.step_time_target_ms is not None and self.has_urgent

    def step_cap(self) -> StepCap | None:
        """This step's time budget: the target while urgent work is in the engine, else
        `max_step_time_ms` (None: the token budget only)."""
        if self.cost_model is None:
            return None
        if self.is_urgent_step:
            min_urgent = max(1, self.config.max_num_batched_tokens // MIN_URGENT_SHARE)
            return StepCap(self.cost_model, self.config.step_time_target_ms, min_urgent)
        if self.config.max_step_time_ms is not None:
            return StepCap(self.cost_model, self.config.max_step_time_ms, keeps_decodes=True)
        return None

    def _peek_waiting(self) -> Request | None:
        while self._waiting:
            _, rid = self._waiting[0]
            req = self.requests.get(rid)
            if req is not None and req.status is RequestStatus.WAITING:
                return req
            heapq.heappop(self._waiting)  # stale: finished or already admitted
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        heapq.heappush(self._waiting, (req.sort_key, req.request_id))

    # -- the step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        self._make_room_for_urgent(out)
        cap = self.step_cap()
        # 1. Running requests, most urgent first. Victims come from the unscheduled tail.
        queue = sorted(self.running, key=lambda r: r.sort_key)
        budget = self.config.max_num_batched_tokens
        if not self.is_urgent_step:
            budget, preempted_now = self._schedule_running(queue, budget, cap, out)
            # 2. Waiting requests, unless this step already had to preempt (admitting now would
            # thrash).
            if not preempted_now:
                self._schedule_waiting(budget, cap, out)
            return out
        # Sized by urgency: running work at least as urgent as the head of the queue, then the
        # waiting work, then the rest of the running work, in what is left of the time budget.
        head = self._peek_waiting()
        head_priority = head.priority if head is not None else math.inf
        budget, preempted_now = self._schedule_running(queue, budget, cap, out, head_priority)
        if not preempted_now:
            budget = self._schedule_waiting(budget, cap, out)
        self._schedule_running(queue, budget, cap, out)
        return out

    def _schedule_running(
        self,
        queue: list[Request],
        budget: int,
        cap: StepCap | None,
        out: SchedulerOutput,
        max_priority: float = math.inf,
    ) -> tuple[int, bool]:
        """Schedule the head of `queue` (sorted, consumed in place) while its priority is at
        most `max_priority`. Returns (token budget left, whether it preempted)."""
        preempted_now = False
        scheduled_running: list[tuple[Request, int]] = []
        while queue and budget > 0 and queue[0].priority <= max_priority:
            req = queue.pop(0)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if cap is not None:
                num_new = cap.take(req.num_computed_tokens, num_new, self._is_urgent(req))
                if num_new == 0:
                    continue  # no time left in this step: it runs in the next one
            while not self.kv.allocate_slots(req, num_new):
                victim = queue.pop() if queue else req
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                preempted_now = True
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                scheduled_running.append((req, num_new))
                budget -= num_new
        for req, num_new in scheduled_running:
            out.scheduled.append(self._scheduled(req, num_new))
        return budget, preempted_now

    def _schedule_waiting(self, budget: int, cap: StepCap | None, out: SchedulerOutput) -> int:
        """Admit waiting requests in order while they fit; one whose next block a request
        admitted before it in this step computes waits for the next step (`_waits_for_blocks`).
        Returns the token budget left."""
        computing: set[bytes] = set()  # full blocks this step's admissions compute
        deferred: list[tuple[tuple[int, int], str]] = []
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._peek_waiting()
            if req is None:
                break
            computed = self.kv.get_computed_blocks(req)
            if computing and self._waits_for_blocks(req, len(computed), computing):
                deferred.append(heapq.heappop(self._waiting))
                continue
            num_cached = len(computed) * self.config.block_size
            num_needed = req.num_tokens - num_cached
            num_new = min(num_needed, budget)
            if cap is not None:
                num_new = cap.take(num_cached, num_new, self._is_urgent(req))
            if num_new == 0 or (num_new < num_needed and not self.config.enable_chunked_prefill):
                break
            if not self.kv.allocate_slots(req, num_new, computed):
                break
            heapq.heappop(self._waiting)
            self._admit(req, num_cached)
            out.scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
            if self.kv.enable_caching:
                hashes = self.kv.full_block_hashes(req, num_cached + num_new)
                computing.update(hashes[len(computed) :])
        for entry in deferred:
            heapq.heappush(self._waiting, entry)
        return budget

    def _waits_for_blocks(self, req: Request, num_cached_blocks: int, computing: set[bytes]) -> bool:
        """Whether `req` should wait a step because its next full block is being computed in
        this one by a request admitted before it: the next step finds it in the prefix cache.
        Requests that share a system prompt or a chat template arrive together (W2's 32 chat
        prompts share their first 25 tokens, one block of 16, of ~38): admitted together, each
        computed the shared blocks again. Waiting costs a request at most one step's fixed cost
        less the shared tokens' compute: it runs in the next step, and the step it leaves is
        shorter by its tokens (on the 2-core CPUs a block of 16 prompt tokens is ~15 ms of
        SmolLM2 prefill, a step's cost outside the model under 1 ms)."""
        if not self.kv.can_take_cached(req):
            return False
        hashes = self.kv.full_block_hashes(req, req.num_tokens - 1)
        return len(hashes) > num_cached_blocks and hashes[num_cached_blocks] in computing

    def _admit(self, req: Request, num_cached: int) -> None:
        if req.num_cached_tokens is None:  # first admission: count the prompt lookup
            req.num_cached_tokens = num_cached
            self.num_prefix_queries += req.num_prompt_tokens
            self.num_prefix_hits += num_cached
        self.num_tokens_reused += num_cached
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _make_room_for_urgent(self, out: SchedulerOutput) -> None:
        """Preempt less urgent running work while the most urgent waiting request cannot be
        admitted. Only strictly less urgent requests are victims, so equal priorities never
        preempt each other (no ping-pong)."""
        while True:
            head = self._peek_waiting()
            if head is None:
                return
            victims = [r for r in self.running if r.priority > head.priority]
            if not victims:
                return
            if len(self.running) < self.config.max_num_seqs and self._fits(head):
                return
            victim = max(victims, key=lambda r: r.sort_key)
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)

    def _fits(self, req: Request) -> bool:
        """Would the first chunk of this waiting request fit in the free blocks right now?"""
        computed = self.kv.get_computed_blocks(req)
        num_cached = len(computed) * self.config.block_size
        num_new = min(req.num_tokens - num_cached, self.config.max_num_batched_tokens)
        # Keep one block per running request for its next decode step, so admitting the
        # urgent request does not immediately force a preemption in the running pass.
        reserve = sum(
            1
            for r in self.running
            if cdiv(r.num_tokens, self.config.block_size) > self.kv.num_blocks_of(r.request_id)
        )
        return self.kv.can_allocate(req, num_new, computed, num_reserved=reserve)

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        self.num_tokens_computed += num_new
        needs_sample = start + num_new == req.num_tokens
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start : start + num_new],
            start_position=start,
            block_ids=self.kv.block_ids(req.request_id),
            needs_sample=needs_sample,
            params=req.params,
            seed=req.seed,
            num_output_tokens=req.num_output_tokens,
            all_token_ids=req.all_token_ids if needs_sample else None,
            grammar=req.grammar if needs_sample else None,
        )

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, publish full blocks to the prefix
        cache. Returns the requests that received a new token (in schedule order)."""
        updated = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished or preempted while the step ran
            req.num_computed_tokens += len(s.token_ids)
            self.kv.cache_computed_blocks(req)
            if self._held and _has_computed_prompt(req):
                self._release_held(req.request_id)
            token = sampled.get(s.request_id)
            if s.needs_sample and token is not None:
                req.append_token(token)
                updated.append(req)
        return updated

    def accept_token(self, req: Request, token: int) -> None:
        """Append a further token a speculative step verified after the one just appended: that
        one's K and V were computed in the same step (engine/fused_decode.py `speculate`)."""
        req.num_computed_tokens += 1
        self.num_tokens_computed += 1
        self.kv.cache_computed_blocks(req)
        req.append_token(token)


def _has_computed_prompt(req: Request) -> bool:
    """The request's prompt has been computed once (its full blocks were offered to the cache)."""
    return req.num_output_tokens > 0 or req.num_computed_tokens >= req.num_prompt_tokens
