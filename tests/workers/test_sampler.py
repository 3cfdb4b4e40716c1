"""The sampler on handcrafted logits (exact or statistically tight expectations), the
sampling-parameter validation, and the stop / length / abort / admission rules of the engine
on a tiny random Llama."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter

import pytest
import torch

from scheduler.sampling_params import SamplingParams, SamplingParamsError
from scheduler.sequence import Sequence
from tests.conftest import make_tiny_llama, track
from workers.engine import EngineConfig, LLMEngine
from workers.sampler import Sampler

CPU = torch.device("cpu")
EOS = 2


def seq(seq_id: str = "s", *, prompt=(7,), out=(), eos=(EOS,), **params) -> Sequence:
    s = Sequence(seq_id, list(prompt), SamplingParams(**params), eos_token_ids=frozenset(eos))
    s.output_token_ids = list(out)
    return s


def rows(values, n: int = 1) -> torch.Tensor:
    """One logits row (a list) repeated n times, float32 [n, V]."""
    return torch.tensor([values], dtype=torch.float32).repeat(n, 1)


def draw(values, n: int, **params) -> list[int]:
    """n independent draws from one row: the row repeated n times in one call, unseeded."""
    seqs = [seq(f"r{i}", **params) for i in range(n)]
    return [r.token for r in Sampler(CPU, seed=1234)(rows(values, n), seqs)]


def greedy(values, **kw) -> int:
    return Sampler(CPU)(rows(values), [seq(temperature=0.0, **kw)])[0].token


def probs_to_logits(probs) -> list[float]:
    return [math.log(p) for p in probs]


# -- greedy and temperature --

def test_greedy_is_argmax_and_top_k_1_always_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 50) * 3
    sampler = Sampler(CPU)
    res = sampler(logits, [seq(f"g{i}", temperature=0.0) for i in range(16)])
    assert [r.token for r in res] == logits.argmax(dim=-1).tolist()
    assert all(r.logprob is None and r.top_logprobs is None for r in res)

    # top_k=1 at temperature 1 on a fairly flat row: every draw is the argmax
    flat = (torch.randn(50) * 0.3).tolist()
    best = max(range(50), key=flat.__getitem__)
    assert set(draw(flat, 2000, top_k=1, temperature=1.0)) == {best}
    # ...while without top_k the same row spreads over many tokens
    assert len(set(draw(flat, 2000, temperature=1.0))) > 30


def test_temperature_matches_softmax_of_scaled_logits():
    values = [1.0, 0.5, 0.0, -0.5, -1.0]
    n = 10_000
    # both temperatures in one batch, interleaved: temperature is applied per row
    seqs = [seq(f"t{i}", temperature=(0.5 if i % 2 == 0 else 2.0)) for i in range(2 * n)]
    tokens = [r.token for r in Sampler(CPU, seed=7)(rows(values, 2 * n), seqs)]
    for parity, t in ((0, 0.5), (1, 2.0)):
        counts = Counter(tokens[parity::2])
        expected = torch.softmax(torch.tensor(values) / t, dim=0).tolist()
        for tok, p in enumerate(expected):
            # binomial std <= 0.005 at n=10k: 0.02 is 4+ sigma, yet T=1 (and swapping the
            # temperatures) would be off by 0.05 or more on the first token
            assert abs(counts[tok] / n - p) < 0.02, (t, tok, counts[tok] / n, p)



@pytest.mark.parametrize("t", [1e-3, 1e-20, 1e-40, 1e-300])
def test_tiny_temperature_is_near_greedy_not_nan(t):
    # a temperature that underflows float32 (or overflows the scaled logits) must not turn
    # the softmax into NaN and return an arbitrary token
    values = [0.5, -1.0, 3.0, 2.0, -300.0]
    assert set(draw(values, 200, temperature=t)) == {2}
    assert set(draw(values, 200, temperature=t, top_k=3, top_p=0.5, min_p=0.1)) == {2}


# -- truncation: top-k, top-p, min-p --

def test_top_k_keeps_exactly_the_k_most_likely():
    values = [0.3, 1.0, -0.2, 0.9, 0.0, 0.8, -1.0, 0.1]  # top-3: tokens 1, 3, 5
    n = 3000
    # at temperature 5 the row is nearly flat, so anything not cut would show up
    assert set(draw(values, n, top_k=3, temperature=5.0)) == {1, 3, 5}
    assert set(draw(values, n, top_k=-1, temperature=5.0)) == set(range(8))
    assert set(draw(values, n, top_k=100, temperature=5.0)) == set(range(8))  # k > V: off
    # per row: a top_k=3 row next to a top_k=0 row in the same call
    seqs = [seq(f"k{i}", top_k=(3 if i % 2 else 0), temperature=5.0) for i in range(n)]
    toks = [r.token for r in Sampler(CPU)(rows(values, n), seqs)]
    assert set(toks[1::2]) == {1, 3, 5}
    assert set(toks[0::2]) == set(range(8))


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 0, 3, 1]])
def test_top_p_keeps_the_smallest_set_reaching_p(order):
    # probabilities 0.5, 0.3, 0.15, 0.05 placed at token ids `order`
    probs = [0.0] * 4
    for tok, p in zip(order, [0.5, 0.3, 0.15, 0.05]):
        probs[tok] = p
    values = probs_to_logits(probs)
    by_rank = order  # by_rank[i] is the i-th most likely token
    n = 4000
    t07 = draw(values, n, top_p=0.7)
    assert set(t07) == {by_rank[0], by_rank[1]}
    # renormalised over the kept set: 0.5 / 0.8
    assert abs(Counter(t07)[by_rank[0]] / n - 0.625) < 0.03
    assert set(draw(values, n, top_p=0.85)) == {by_rank[0], by_rank[1], by_rank[2]}
    assert set(draw(values, n, top_p=0.96)) == set(range(4))
    # a tiny p still keeps the most likely token, even when 1 - p rounds to 1 in float32
    for tiny in (1e-6, 1e-9, 1e-30):
        assert set(draw(values, 500, top_p=tiny)) == {by_rank[0]}
    assert set(draw(values, 500, top_p=0.4)) == {by_rank[0]}


def test_top_p_rows_are_independent():
    values = probs_to_logits([0.5, 0.3, 0.15, 0.05])
    n = 3000
    seqs = [seq(f"p{i}", top_p=(0.7 if i % 2 else 1.0)) for i in range(n)]
    toks = [r.token for r in Sampler(CPU)(rows(values, n), seqs)]
    assert set(toks[1::2]) == {0, 1}
    assert set(toks[0::2]) == {0, 1, 2, 3}


def test_min_p_drops_tokens_below_fraction_of_max():
    values = probs_to_logits([0.1, 0.4, 0.05, 0.3, 0.15])
    n = 4000
    # threshold 0.3 * 0.4 = 0.12: tokens with 0.1 and 0.05 never appear
    assert set(draw(values, n, min_p=0.3)) == {1, 3, 4}
    assert set(draw(values, n, min_p=0.5)) == {1, 3}  # threshold 0.2
    assert set(draw(values, n, min_p=1.0)) == {1}
    assert set(draw(values, n, min_p=0.0)) == set(range(5))


# -- penalties --

def ref_penalized(values, s: Sequence) -> list[float]:
    """HF repetition penalty over prompt+output (once per distinct token), then OpenAI
    frequency/presence penalties over the output only."""
    out = list(values)
    p = s.params
    for t in set(s.prompt_token_ids) | set(s.output_token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    counts = Counter(s.output_token_ids)
    for t, c in counts.items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_repetition_penalty_hf_semantics():
    # positive logit divided: 3.0 / 2 = 1.5 < 2.5
    assert greedy([3.0, 2.5, 0.0], repetition_penalty=1.0, prompt=[0]) == 0
    assert greedy([3.0, 2.5, 0.0], repetition_penalty=2.0, prompt=[0]) == 1
    # output tokens count too
    assert greedy([3.0, 2.5, 0.0], repetition_penalty=2.0, prompt=[2], out=[0]) == 1
    # applied once per distinct token, however often it occurs: 4.0 / 2 = 2.0 > 1.5
    assert greedy([4.0, 1.5, 0.0], repetition_penalty=2.0, prompt=[0, 0], out=[0, 0]) == 0
    # negative logit multiplied: -1.0 * 2 = -2.0 < -1.5 (dividing would give -0.5)
    assert greedy([-1.0, -1.5, -3.0], repetition_penalty=2.0, prompt=[0]) == 1
    # a penalty below 1 rewards: -2.0 * 0.5 = -1.0 > -1.5; 1.0 / 0.5 = 2.0 > 1.5
    assert greedy([-2.0, -1.5, -3.0], repetition_penalty=0.5, prompt=[0]) == 0
    assert greedy([1.0, 1.5, -3.0], repetition_penalty=0.5, prompt=[2], out=[0]) == 0


def test_frequency_and_presence_penalties_openai_semantics():
    v = [2.0, 1.6, 1.0, 0.0]
    # frequency: scaled by the count. 2.0 - 0.3 = 1.7 > 1.6; 2.0 - 0.6 = 1.4 < 1.6
    assert greedy(v, frequency_penalty=0.3, out=[0]) == 0
    assert greedy(v, frequency_penalty=0.3, out=[0, 0]) == 1
    # presence: once, whatever the count. 2.0 - 0.3 = 1.7 > 1.6, even after three 0s
    assert greedy(v, presence_penalty=0.3, out=[0, 0, 0]) == 0
    assert greedy(v, presence_penalty=0.5, out=[0]) == 1
    # both: 2.0 - 2 * 0.1 - 0.25 = 1.55 < 1.6
    assert greedy(v, frequency_penalty=0.1, presence_penalty=0.25, out=[0, 0]) == 1
    assert greedy(v, frequency_penalty=0.1, presence_penalty=0.15, out=[0, 0]) == 0
    # output tokens only: the prompt is never penalised
    assert greedy(v, frequency_penalty=2.0, presence_penalty=2.0, prompt=[0, 0, 0]) == 0
    # negative values encourage: 1.6 + 0.5 = 2.1 > 2.0
    assert greedy(v, frequency_penalty=-0.5, out=[1]) == 1
    assert greedy(v, presence_penalty=-0.5, out=[1, 1]) == 1  # 1.6 + 0.5 = 2.1 > 2.0
    assert greedy(v, presence_penalty=-0.5, out=[2, 2]) == 0  # 1.0 + 0.5 = 1.5 < 2.0


def test_penalties_match_reference_on_random_cases_and_leave_input_alone():
    g = torch.Generator().manual_seed(3)
    sampler = Sampler(CPU)
    for case in range(200):
        v = (torch.randn(12, generator=g) * 2).tolist()
        prompt = torch.randint(0, 12, (4,), generator=g).tolist()
        out = torch.randint(0, 12, (int(torch.randint(0, 6, (1,), generator=g)),),
                            generator=g).tolist()
        kw = dict(repetition_penalty=[1.0, 1.3, 0.7][case % 3],
                  frequency_penalty=[0.0, 0.4, -0.3][(case // 3) % 3],
                  presence_penalty=[0.0, 0.6, -0.2][(case // 9) % 3])
        s = seq(prompt=prompt, out=out, temperature=0.0, **kw)
        logits = rows(v)
        before = logits.clone()
        tok = sampler(logits, [s])[0].token
        ref = ref_penalized(v, s)
        assert tok == max(range(12), key=ref.__getitem__), (case, kw, prompt, out)
        assert torch.equal(logits, before)  # the caller's logits are not modified


# -- min_tokens --

def test_min_tokens_suppresses_eos_and_stop_tokens():
    v = [0.0, 1.0, 5.0, 4.0, 3.0]  # EOS (2) best, then token 3, then 4
    # fewer than min_tokens outputs: EOS banned
    assert greedy(v, min_tokens=3, out=[1, 1]) == 3
    assert greedy(v, min_tokens=3, out=[1, 1, 1]) == EOS
    assert greedy(v, min_tokens=0) == EOS
    # stop_token_ids banned too
    assert greedy(v, min_tokens=1, stop_token_ids=(3,)) == 4
    assert greedy(v, min_tokens=1, stop_token_ids=(3,), out=[0]) == EOS
    # ignore_eos: EOS is an ordinary token, but stop tokens are still held back
    assert greedy(v, min_tokens=2, ignore_eos=True) == EOS
    assert greedy(v, min_tokens=2, ignore_eos=True, stop_token_ids=(2, 3)) == 4
    # several EOS ids
    assert greedy(v, min_tokens=2, eos=(2, 3)) == 4
    # stop ids outside the vocabulary are never sampled anyway: no IndexError, and a negative
    # id does not ban a token counted from the end of the vocabulary
    v4 = [0.0, 1.0, 0.5, 3.0]
    assert greedy(v4, min_tokens=2, stop_token_ids=(9999, -1)) == 3
    assert greedy(v4, min_tokens=2, stop_token_ids=(9999, -1, 3)) == 1
    assert greedy(v4, min_tokens=2, eos=(-4, 50)) == 3
    # sampled rows: never drawn while banned, drawn once allowed
    flat = [0.0, 0.1, 0.2, 0.3, 0.4]
    assert not {EOS, 3} & set(draw(flat, 2000, min_tokens=1, stop_token_ids=(3,)))
    assert {EOS, 3} <= set(draw(flat, 2000, min_tokens=0, stop_token_ids=(3,)))


# -- seeds --

STEPS = 24
V = 40
STEP_LOGITS = torch.randn(STEPS, V, generator=torch.Generator().manual_seed(11)) * 0.5


def stream(sampler: Sampler, target: Sequence, others=(), first: bool = True) -> list[int]:
    """Sample STEPS tokens for `target` in a batch with `others` (placed after it, or before
    it when first is False); every sequence gets its own fresh token each step."""
    out = []
    for step in range(STEPS):
        batch = [target, *others] if first else [*others, target]
        logits = STEP_LOGITS[step].repeat(len(batch), 1)
        logits[[i for i, s in enumerate(batch) if s is not target]] += torch.randn(
            len(batch) - 1, V)
        res = sampler(logits, batch)
        for s, r in zip(batch, res):
            s.output_token_ids.append(r.token)
        out.append(res[batch.index(target)].token)
    return out


def test_same_seed_same_stream_in_any_batch():
    kw = dict(seed=42, temperature=0.9, top_p=0.95)
    alone = stream(Sampler(CPU, seed=0), seq("x", **kw))
    assert len(set(alone)) > 5  # really sampled, not stuck on one token
    # another Sampler instance (other global seed), with other rows in the batch
    mixed = stream(Sampler(CPU, seed=99), seq("x", **kw), others=[
        seq("u1", temperature=0.5),
        seq("s2", seed=7, temperature=1.3, top_k=5),
        seq("g", temperature=0.0),
        seq("u2", temperature=1.0, min_p=0.2, top_p=0.5),
    ])
    assert mixed == alone
    # different rows, the target last, a different sampler seed again
    reordered = stream(Sampler(CPU, seed=5), seq("x", **kw), first=False, others=[
        seq("s3", seed=42, temperature=2.0),  # same seed, other sequence
        seq("u3", temperature=0.3, repetition_penalty=1.2),
    ])
    assert reordered == alone
    # unseeded rows do not repeat across sampler seeds, so the match above is the seed's doing
    kw_unseeded = dict(temperature=0.9, top_p=0.95)
    assert (stream(Sampler(CPU, seed=1), seq("x", **kw_unseeded))
            != stream(Sampler(CPU, seed=2), seq("x", **kw_unseeded)))


def test_different_seeds_differ():
    streams = {s: stream(Sampler(CPU), seq("x", seed=s, temperature=1.0)) for s in (1, 2, 3)}
    assert streams[1] != streams[2] and streams[2] != streams[3] and streams[1] != streams[3]
    # out-of-int64 and negative seeds are accepted and deterministic too
    for s in (-5, 2**64 - 1):
        a = stream(Sampler(CPU), seq("x", seed=s, temperature=1.0))
        assert a == stream(Sampler(CPU), seq("x", seed=s, temperature=1.0))


def test_forget_resets_the_generator():
    kw = dict(seed=123, temperature=1.0)
    sampler = Sampler(CPU)
    first = stream(sampler, seq("x", **kw))
    # same id, not forgotten: the generator carries on from where it was
    assert stream(sampler, seq("x", **kw)) != first
    sampler.forget("x")
    assert stream(sampler, seq("x", **kw)) == first
    sampler.forget("never-seen")  # forgetting an unknown id is harmless


# -- logprobs --

def test_logprobs_are_raw_model_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(5, 30) * 2
    raw = torch.log_softmax(logits, dim=-1)
    seqs = [
        seq("a", temperature=0.0, logprobs=5),
        seq("b", temperature=0.5, logprobs=3, seed=1),
        seq("c", temperature=0.0, logprobs=0),
        seq("d", temperature=0.0, logprobs=None),
        # penalised and sampled: the logprob is still of the unpenalised, unscaled logits
        seq("e", temperature=2.0, top_k=4, logprobs=20, repetition_penalty=3.0,
            prompt=[int(logits[4].argmax())], out=[1, 1], frequency_penalty=1.0),
    ]
    res = Sampler(CPU)(logits, seqs)
    for i, (s, r) in enumerate(zip(seqs, res)):
        n = s.params.logprobs
        if n is None:
            assert r.logprob is None and r.top_logprobs is None
            continue
        assert r.logprob == pytest.approx(float(raw[i, r.token]), abs=1e-6)
        if n == 0:
            assert r.top_logprobs is None
            continue
        assert len(r.top_logprobs) == n
        ids = [t for t, _ in r.top_logprobs]
        lps = [lp for _, lp in r.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert ids == raw[i].argsort(descending=True)[:n].tolist()
        for t, lp in r.top_logprobs:
            assert lp == pytest.approx(float(raw[i, t]), abs=1e-6)
    assert res[0].token == int(logits[0].argmax())
    assert res[0].top_logprobs[0] == (res[0].token, pytest.approx(res[0].logprob))
    # the penalised row's token need not be the raw argmax, yet its logprob is the raw one
    assert res[4].logprob == pytest.approx(float(raw[4, res[4].token]), abs=1e-6)


def test_logprobs_for_every_row_of_a_large_batch():
    torch.manual_seed(6)
    logits = torch.randn(64, 100)
    res = Sampler(CPU)(logits, [seq(f"r{i}", logprobs=1) for i in range(64)])
    raw = torch.log_softmax(logits, dim=-1)
    for i, r in enumerate(res):
        assert r.logprob == pytest.approx(float(raw[i, r.token]), abs=1e-6)
        assert r.top_logprobs[0][0] == int(logits[i].argmax())


# -- validation --

@pytest.mark.parametrize("kw,param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=101.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.1), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=11.0), "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(seed=2**64), "seed"),
])
def test_validate_rejects_out_of_range(kw, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kw).validate()
    assert info.value.param == param
    assert isinstance(info.value, ValueError)


def test_validate_accepts_edges():
    for kw in (dict(), dict(temperature=0.0), dict(temperature=100.0), dict(top_p=1.0),
               dict(top_k=-1), dict(top_k=0), dict(min_p=1.0), dict(presence_penalty=-2.0),
               dict(frequency_penalty=2.0), dict(repetition_penalty=10.0), dict(logprobs=0),
               dict(logprobs=20), dict(max_tokens=4, min_tokens=4), dict(seed=-(2**63))):
        p = SamplingParams(**kw)
        assert p.validate() is p


# -- the engine: stop tokens, length, ignore_eos, abort, admission --

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("sampler_tiny"), max_pos=64)


def make_engine(folder) -> LLMEngine:
    return track(LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64,
                                        block_size=4)))


@pytest.fixture(scope="module")
def engine(tiny_folder):
    return make_engine(tiny_folder)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Add the requests, step to completion; tokens and finish reason of each."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid in requests}
    reasons = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id not in reasons, "output after the request finished"
            tokens[o.request_id].extend(o.token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return tokens, reasons


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[t, (t * 7) % 211, (t * 13) % 211] for t in range(3, 15)]  # 12 x 4 blocks fit


@pytest.fixture(scope="module")
def references(engine):
    """Greedy continuations (EOS ignored) of PROMPTS: the expected token streams."""
    outs = engine.generate(PROMPTS, GREEDY)
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    return outs


def first_new_token(refs, avoid=(), lo: int = 1, hi: int = 10) -> tuple[int, int]:
    """(prompt index, position j in [lo, hi]) where refs[i][j] appears for the first time and
    nothing in `avoid` appears up to j."""
    for i, o in enumerate(refs):
        for j in range(lo, hi + 1):
            if o[j] not in o[:j] and not set(avoid) & set(o[:j + 1]):
                return i, j
    raise AssertionError("no usable greedy continuation; change PROMPTS")


def test_engine_stop_tokens_and_length(engine, references):
    eos = engine.model_config.eos_token_ids
    m, j = first_new_token(references, avoid=eos)
    stop = references[m][j]
    tokens, reasons = run(engine, {
        "stop": (PROMPTS[m], SamplingParams(max_tokens=12, temperature=0.0,
                                            stop_token_ids=(stop,))),
        # out-of-vocab stop ids, banned by min_tokens on the first step: harmless
        "stop2": (PROMPTS[m], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                             stop_token_ids=(9999, -1, stop), min_tokens=1)),
        "length": (PROMPTS[m], SamplingParams(max_tokens=5, temperature=0.0,
                                              ignore_eos=True)),
        "min": (PROMPTS[m], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                           stop_token_ids=(stop,), min_tokens=12)),
    })
    assert tokens["stop"] == references[m][:j + 1] and reasons["stop"] == "stop"
    assert tokens["stop"][-1] == stop
    assert tokens["stop2"] == tokens["stop"] and reasons["stop2"] == "stop"
    assert tokens["length"] == references[m][:5] and reasons["length"] == "length"
    # min_tokens covers the whole request: the stop token is never produced, the length ends it
    assert len(tokens["min"]) == 12 and stop not in tokens["min"]
    assert reasons["min"] == "length"
    assert engine.blocks.num_used_blocks == 0


def test_engine_eos_and_ignore_eos(engine, references, tiny_folder, tmp_path):
    # Make a token that greedy decoding is known to produce the model's EOS: copy the folder
    # with eos_token_id rewritten, so this does not depend on what the random weights emit.
    i, k = first_new_token(references)
    eos = references[i][k]
    folder = tmp_path / "eos_model"
    shutil.copytree(tiny_folder, folder)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    eng = make_engine(folder)
    assert eng.model_config.eos_token_ids == (eos,)
    tokens, reasons = run(eng, {
        "eos": (PROMPTS[i], SamplingParams(max_tokens=12, temperature=0.0)),
        "ignore": (PROMPTS[i], GREEDY),
    })
    assert tokens["eos"] == references[i][:k + 1] and reasons["eos"] == "stop"
    assert tokens["ignore"] == references[i] and reasons["ignore"] == "length"
    assert eos in tokens["ignore"][:-1]  # it went on past EOS
    assert eng.blocks.num_used_blocks == 0


def test_engine_abort_frees_blocks(engine, references):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("keep", PROMPTS[0], params)
    engine.add_request("drop", PROMPTS[1], params)
    seen = {"keep": [], "drop": []}
    while len(seen["drop"]) < 3:
        for o in engine.step():
            seen[o.request_id].extend(o.token_ids)
    held_keep = engine.blocks.num_blocks_held("keep")
    assert engine.blocks.num_blocks_held("drop") > 0
    assert engine.abort("drop") is True
    assert not engine.blocks.has("drop")
    assert engine.blocks.num_used_blocks == held_keep
    assert engine.abort("drop") is False  # already gone
    finished = None
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == "keep"
            seen["keep"].extend(o.token_ids)
            finished = o.finish_reason if o.finished else finished
    assert seen["keep"] == references[0] and finished == "length"
    assert seen["drop"] == references[1][:len(seen["drop"])]
    assert engine.blocks.num_used_blocks == 0


def test_engine_add_request_rejects_bad_prompts(engine):
    p = SamplingParams(max_tokens=4)
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("empty", [], p)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("oov", [1, vocab], p)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("neg", [1, -1], p)
    assert engine.max_model_len == 64
    for n in (64, 65, 200):
        with pytest.raises(ValueError, match="context window"):
            engine.add_request("long", [5] * n, p)
    with pytest.raises(SamplingParamsError):
        engine.add_request("badp", [5], SamplingParams(top_p=0.0))
    assert not engine.has_unfinished()
    # none of those was registered: the ids are free, and a prompt just inside the window runs
    tokens, reasons = run(engine, {"long": ([5] * 63, SamplingParams(max_tokens=4,
                                                                       ignore_eos=True))})
    assert len(tokens["long"]) == 1 and reasons["long"] == "length"  # 63 + 1 = window
