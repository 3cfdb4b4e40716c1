"""Our Llama implementation against transformers on the same random weights (float32)."""

import pytest
import torch

from scheduler.sampling_params import SamplingParams
from tests.conftest import make_tiny_llama, track
from workers.attention import build_metadata
from workers.engine import EngineConfig, LLMEngine

CONFIGS = {
    "gqa_tied": dict(hidden=64, heads=4, kv_heads=2),
    "mha_untied": dict(hidden=48, heads=3, kv_heads=3, tie=False, theta=500000.0),
    "odd_heads_mqa": dict(hidden=80, heads=5, kv_heads=1, intermediate=72, layers=3),
    "head_dim_override": dict(hidden=96, heads=6, kv_heads=2, head_dim=24, tie=False),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_llama(tmp_path_factory.mktemp(request.param), **CONFIGS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    engine = track(LLMEngine(EngineConfig(model=str(folder), dtype="float32", block_size=4,
                                          num_kv_blocks=256, max_num_batched_tokens=7)))
    return hf, engine


@torch.inference_mode()
def our_logits(engine, prompt, chunks):
    """Run `prompt` through the model in the given chunk sizes; logits of every position."""
    seq_id = "logits-probe"
    engine.blocks.grow(seq_id, len(prompt))
    table = engine.blocks.table(seq_id)
    out, start = [], 0
    try:
        for n in chunks:
            meta = build_metadata([(table, start, n)], engine.blocks.block_size, engine.device)
            h = engine.model.forward(torch.tensor(prompt[start:start + n]),
                                     torch.arange(start, start + n), meta, engine.kv)
            out.append(engine.model.compute_logits(h))
            start += n
    finally:
        engine.blocks.free(seq_id)
    return torch.cat(out)


def test_logits_match_transformers(tiny):
    hf, engine = tiny
    torch.manual_seed(1)
    prompt = torch.randint(0, hf.config.vocab_size, (23,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    # whole prompt at once, in uneven chunks (reads earlier chunks from the paged cache),
    # and token by token (the decode path)
    for chunks in ([23], [5, 11, 7], [1] * 23):
        ours = our_logits(engine, prompt, chunks)
        assert (ours - ref).abs().max().item() < 1e-4, chunks


def test_batched_greedy_with_small_prefill_chunks(tiny):
    from tests.conftest import hf_greedy

    hf, engine = tiny
    torch.manual_seed(2)
    # prompts longer than max_num_batched_tokens (7): chunked while the others decode
    prompts = [torch.randint(0, hf.config.vocab_size, (n,)).tolist() for n in (3, 19, 8, 1, 12)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                   ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(hf, p, 32)
    assert engine.blocks.num_used_blocks == 0


def test_bfloat16_engine_tracks_float32_reference(tmp_path):
    """bfloat16 weights and KV (on CPUs without BF16 instructions: float32 arithmetic on
    bfloat16 operands): logits stay within bfloat16 rounding of the float32 reference, for
    the many-row (prefill) and one-row (decode) paths alike."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_llama(tmp_path / "m", **CONFIGS["gqa_tied"])
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eng = track(LLMEngine(EngineConfig(model=str(folder), dtype="bfloat16", block_size=4,
                                       num_kv_blocks=64)))
    assert eng.kv.tensor.dtype == torch.bfloat16
    torch.manual_seed(3)
    prompt = torch.randint(0, hf.config.vocab_size, (19,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    outs = []
    for chunks in ([19], [1] * 19):
        ours = our_logits(eng, prompt, chunks)
        err = (ours - ref).abs().max().item()
        assert err < 0.05 * ref.abs().max().item(), (chunks, err)
        outs.append(ours)
    # the batched (upcast GEMM) and one-row (bf16 GEMV) paths agree with each other too
    assert (outs[0] - outs[1]).abs().max().item() < 0.03 * ref.abs().max().item()
