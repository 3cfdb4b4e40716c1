"""The batch policy alone: no torch, no model. A fake 'execution' commits chunks and
appends a token whenever a chunk samples."""


from cache.block_pool import BlockManager
from scheduler.batch_policy import BatchPolicy, BatchPolicyConfig
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import FinishReason, SeqStatus, Sequence


def make_seq(i, prompt_len, max_tokens=4, arrival=None, priority=0):
    s = Sequence(f"s{i}", list(range(prompt_len)),
                 SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority))
    s.arrival_time = float(i if arrival is None else arrival)
    return s


def run_step(policy):
    plan = policy.schedule()
    for c in plan.chunks:
        policy.commit(c)
        if c.samples:
            reason = c.seq.append_token(7)
            if reason:
                policy.remove(c.seq, reason)
    return plan


def test_chunked_prefill_interleaves_with_decodes():
    policy = BatchPolicy(BatchPolicyConfig(max_num_batched_tokens=8, max_num_seqs=8),
                         BlockManager(100, 4))
    short = make_seq(0, 3, max_tokens=10)
    policy.add(short)
    run_step(policy)  # short prefilled, first token sampled
    long = make_seq(1, 20)
    policy.add(long)
    plan = run_step(policy)
    # the decode (1 token) goes first, the long prompt gets the rest of the 8-token budget
    assert [(c.seq.seq_id, c.num_tokens) for c in plan.chunks] == [("s0", 1), ("s1", 7)]
    assert not plan.chunks[1].samples
    plan = run_step(policy)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in plan.chunks] == [
        ("s0", 4, 1), ("s1", 7, 7)]
    plan = run_step(policy)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in plan.chunks] == [
        ("s0", 5, 1), ("s1", 14, 6)]
    assert plan.chunks[1].samples and long.num_output_tokens == 1
    while policy.has_work():
        assert run_step(policy).num_tokens <= 8
    assert policy.blocks.num_used_blocks == 0


def test_max_num_seqs_and_budget_limit_admission():
    policy = BatchPolicy(BatchPolicyConfig(max_num_batched_tokens=100, max_num_seqs=3),
                         BlockManager(100, 4))
    for i in range(5):
        policy.add(make_seq(i, 10))
    plan = run_step(policy)
    assert len(plan.chunks) == 3 and policy.num_waiting == 2
    while policy.has_work():
        plan = run_step(policy)
        assert len(plan.chunks) <= 3
    assert policy.blocks.num_used_blocks == 0


def test_preemption_when_blocks_run_out_recomputes_latest_arrival():
    # 6 blocks of 4 tokens. Two sequences of 8-token prompts fill 4 blocks; decoding grows them
    policy = BatchPolicy(BatchPolicyConfig(max_num_batched_tokens=64, max_num_seqs=8),
                         BlockManager(6, 4))
    a, b = make_seq(0, 8, max_tokens=12), make_seq(1, 8, max_tokens=12)
    policy.add(a)
    policy.add(b)
    preempted = []
    steps = 0
    while policy.has_work() and steps < 200:
        plan = run_step(policy)
        preempted += [s.seq_id for s in plan.preempted]
        assert policy.blocks.num_used_blocks <= 6
        steps += 1
    assert preempted and set(preempted) == {"s1"}  # the later arrival is the victim
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert policy.blocks.num_used_blocks == 0


def test_priority_decides_the_victim():
    policy = BatchPolicy(BatchPolicyConfig(max_num_batched_tokens=64, max_num_seqs=8),
                         BlockManager(6, 4))
    a = make_seq(0, 8, max_tokens=12, priority=5)  # earlier but less important
    b = make_seq(1, 8, max_tokens=12, priority=0)
    policy.add(a)
    policy.add(b)
    victims = set()
    while policy.has_work():
        victims |= {s.seq_id for s in run_step(policy).preempted}
    assert victims == {"s0"}


def test_remove_waiting_and_running():
    policy = BatchPolicy(BatchPolicyConfig(max_num_batched_tokens=4, max_num_seqs=1),
                         BlockManager(10, 4))
    a, b = make_seq(0, 3), make_seq(1, 3)
    policy.add(a)
    policy.add(b)
    run_step(policy)
    policy.remove(a, FinishReason.ABORT)
    policy.remove(b, FinishReason.ABORT)
    assert a.status is SeqStatus.FINISHED and b.finish_reason is FinishReason.ABORT
    assert not policy.has_work() and policy.blocks.num_used_blocks == 0


def test_stop_conditions():
    p = SamplingParams(max_tokens=5, stop_token_ids=(9,), min_tokens=2)
    s = Sequence("x", [1, 2], p, eos_token_ids=frozenset({2}))
    assert s.append_token(2) is None  # EOS before min_tokens is not a stop
    assert s.append_token(2) is FinishReason.STOP
    s = Sequence("y", [1], p, eos_token_ids=frozenset({2}))
    s.append_token(3)
    assert s.append_token(9) is FinishReason.STOP
    s = Sequence("z", [1], SamplingParams(max_tokens=3, ignore_eos=True),
                 eos_token_ids=frozenset({2}))
    assert [s.append_token(2) for _ in range(3)] == [None, None, FinishReason.LENGTH]
    s = Sequence("w", [1, 1, 1], SamplingParams(max_tokens=100), max_model_len=5)
    assert [s.append_token(4) for _ in range(2)] == [None, FinishReason.LENGTH]
