"""The real default model (SmolLM2-135M-Instruct GGUF) in float32 against transformers."""

import pytest

from scheduler.sampling_params import SamplingParams
from server.tokenizer import chat_prompt_ids
from tests.conftest import hf_greedy

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def chat_prompts(smollm2_tokenizer):
    return [chat_prompt_ids(smollm2_tokenizer, [{"role": "user", "content": c}]) for c in CHATS]


def test_config_from_gguf_metadata(smollm2_engine):
    cfg = smollm2_engine.model_config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30, 576, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings
    assert cfg.vocab_size == 49152 and cfg.eos_token_ids == (2,)
    assert smollm2_engine.kv_layout.bytes_per_token == 46_080  # float32


def test_greedy_chat_matches_transformers(smollm2_engine, smollm2_hf, chat_prompts):
    outs = smollm2_engine.generate(
        chat_prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(chat_prompts, outs):
        assert out == hf_greedy(smollm2_hf, prompt, 48)


def test_chat_answer_is_sensible(smollm2_engine, smollm2_tokenizer, chat_prompts):
    out = smollm2_engine.generate(chat_prompts[:1], SamplingParams(max_tokens=20,
                                                                   temperature=0.0))[0]
    assert "Paris" in smollm2_tokenizer.decode(out)
    assert out[-1] == 2 or len(out) == 20  # stops at <|im_end|>


def test_batch_invariance_greedy_and_seeded(smollm2_engine, smollm2_tokenizer, chat_prompts):
    eng = smollm2_engine
    target = chat_prompts[1]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                            ignore_eos=True)
    alone_greedy = eng.generate([target], greedy)[0]
    alone_seeded = eng.generate([target], seeded)[0]
    # the same requests inside a mixed batch of 8: other prompts, lengths and sampling settings
    others = [chat_prompts[0], chat_prompts[2], chat_prompts[3], target[:9], chat_prompts[0][:20],
              chat_prompts[2] + chat_prompts[3]]
    other_params = [SamplingParams(max_tokens=m, temperature=t, ignore_eos=True)
                    for m, t in zip((5, 30, 12, 40, 8, 17), (0.0, 1.0, 0.7, 0.0, 1.3, 0.5))]
    mixed = eng.generate([target, *others, target],
                         [greedy, *other_params, seeded])
    assert mixed[0] == alone_greedy
    assert mixed[-1] == alone_seeded
    # and a different seed gives a different continuation
    other_seed = eng.generate([target], SamplingParams(max_tokens=24, temperature=0.9,
                                                       top_p=0.95, top_k=50, seed=99,
                                                       ignore_eos=True))[0]
    assert other_seed != alone_seeded
    assert eng.blocks.num_used_blocks == 0
