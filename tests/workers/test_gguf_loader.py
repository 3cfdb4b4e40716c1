"""The GGUF loader on a tiny random Llama written with gguf.GGUFWriter: all eight tensor types
we claim (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) in one file, llama.cpp's Q/K row
permutation undone, and logits equal to transformers on the same (dequantized) weights.

The numpy quantizers in gguf do not implement Q4_K / Q6_K, so this module encodes those
blocks itself (byte layout of llama.cpp's block_q4_K / block_q6_K); the reference weights are
always what `gguf.quants.dequantize` makes of the bytes written to the file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import track
from tests.workers.test_llama_vs_hf import our_logits
from workers.engine import EngineConfig, LLMEngine
from workers.loaders.gguf_loader import SUPPORTED_QTYPES, load_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
QK_K = 256

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 300
HEAD_DIM = HIDDEN // HEADS
EPS, THETA, CTX, BOS, EOS = 1e-6, 50000.0, 256, 1, 2

# HF name -> GGML type. Every type appears; Q and K get quantized types in layer 1 so the
# un-permutation is checked on dequantized blocks too.
GLOBAL_TYPES = {
    "model.embed_tokens.weight": Q.Q8_0,
    "model.norm.weight": Q.F32,
    "lm_head.weight": Q.Q6_K,
}
LAYER_TYPES = [
    {"self_attn.q_proj": Q.F16, "self_attn.k_proj": Q.BF16, "self_attn.v_proj": Q.Q4_0,
     "self_attn.o_proj": Q.Q4_1, "mlp.gate_proj": Q.Q4_K, "mlp.up_proj": Q.Q6_K,
     "mlp.down_proj": Q.Q8_0},
    {"self_attn.q_proj": Q.Q4_K, "self_attn.k_proj": Q.Q6_K, "self_attn.v_proj": Q.BF16,
     "self_attn.o_proj": Q.F16, "mlp.gate_proj": Q.Q4_1, "mlp.up_proj": Q.Q4_0,
     "mlp.down_proj": Q.Q4_K},
]
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


# -- K-quant encoders (byte layout as gguf/quants.py decodes it) --

def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256*144] uint8: d, dmin (f16), 12 bytes of 6-bit
    scales/mins, 128 bytes of 4-bit quants; value = d*sc*q - dmin*m per 32-element group."""
    rows = x.shape[0]
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 15.0
    mins = -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    d32 = np.where(d == 0, 1.0, d.astype(np.float32))[:, None]
    dmin32 = np.where(dmin == 0, 1.0, dmin.astype(np.float32))[:, None]
    sc = np.clip(np.rint(scale / d32), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / dmin32), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    off = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.rint((sub + off) / np.where(step == 0, 1.0, step)), 0, 15).astype(np.uint8)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    assert out.shape[1] == gguf.GGML_QUANT_SIZES[Q.Q4_K][1]
    return out.reshape(rows, -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256*210] uint8: 128 bytes low nibbles, 64 bytes high
    2-bit pairs, 16 int8 scales, d (f16); value = d*scale*(q-32) per 16-element group."""
    rows = x.shape[0]
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    sub_scale = np.abs(sub).max(-1) / 31.0
    d = (sub_scale.max(-1) / 127.0).astype(np.float16)
    d32 = np.where(d == 0, 1.0, d.astype(np.float32))[:, None]
    scales = np.clip(np.rint(sub_scale / d32), 1, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * scales)[..., None]
    q = np.clip(np.rint(sub / np.where(step == 0, 1.0, step)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(n, QK_K)
    low, high = q & 0x0F, q >> 4
    low = low.reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = high.reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(n, 64)
    out = np.concatenate([ql, qh, scales.view(np.uint8), _f16_bytes(d)], axis=1)
    assert out.shape[1] == gguf.GGML_QUANT_SIZES[Q.Q6_K][1]
    return out.reshape(rows, -1)


def encode(x: np.ndarray, qtype) -> np.ndarray:
    """Bytes (or an F32/F16 array) to hand to GGUFWriter.add_tensor(raw_dtype=qtype)."""
    if qtype == Q.Q4_K:
        return encode_q4_k(x)
    if qtype == Q.Q6_K:
        return encode_q6_k(x)
    return gguf.quants.quantize(x.astype(np.float32), qtype)


def decode(raw: np.ndarray, qtype, shape) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)


# -- llama.cpp's Q/K permutation, and its inverse by explicit row indices --

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """As LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF row h*D + half*D/2 + k was stored at row h*D + 2k + half."""
    d = w.shape[0] // n_head
    src = [h * d + 2 * k + half for h in range(n_head) for half in (0, 1) for k in range(d // 2)]
    return w[np.array(src)]


# -- the tiny model and its GGUF file --

def tiny_hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        rope_theta=THETA, tie_word_embeddings=False, max_position_embeddings=CTX,
        rms_norm_eps=EPS, bos_token_id=BOS, eos_token_id=EOS,
    )


def tiny_state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_hf_config())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            else:  # RMSNorm gains: not all ones, so a lost norm weight shows
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def tokenizer_metadata(w) -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581tok{i}" for i in range(VOCAB - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (VOCAB - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(VOCAB - 259)])
    w.add_token_types(types)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(0)


def write_tiny_gguf(path, state: dict[str, np.ndarray], arch: str = "llama"):
    """Write `state` (HF names/layout) as a llama.cpp-style GGUF. Returns the reference
    weights: HF names, what gguf dequantizes from the written bytes, Q/K un-permuted."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test-llama")
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(THETA)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokenizer_metadata(w)

    plan = [("token_embd.weight", "model.embed_tokens.weight",
             GLOBAL_TYPES["model.embed_tokens.weight"])]
    for i in range(LAYERS):
        for hf, short in GGUF_LAYER_NAMES.items():
            qtype = LAYER_TYPES[i].get(hf, Q.F32)  # the RMSNorm gains stay F32
            plan.append((f"blk.{i}.{short}.weight", f"model.layers.{i}.{hf}.weight", qtype))
    plan += [("output_norm.weight", "model.norm.weight", GLOBAL_TYPES["model.norm.weight"]),
             ("output.weight", "lm_head.weight", GLOBAL_TYPES["lm_head.weight"])]

    reference: dict[str, torch.Tensor] = {}
    for gguf_name, hf, qtype in plan:
        x = state[hf]
        n_head = HEADS if ".q_proj." in hf else KV_HEADS if ".k_proj." in hf else None
        if n_head is not None:
            x = llama_cpp_permute(x, n_head)
        raw = encode(x, qtype)
        w.add_tensor(gguf_name, raw, raw_dtype=qtype)
        ref = decode(raw, qtype, x.shape)
        if n_head is not None:
            ref = unpermute_rows(ref, n_head)
        reference[hf] = torch.from_numpy(np.ascontiguousarray(ref))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    state = tiny_state_dict()
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    reference = write_tiny_gguf(path, state)
    return path, state, reference


# -- tests --

def test_k_quant_encoders_round_trip():
    """The hand-made Q4_K/Q6_K blocks decode (by gguf) to roughly the encoded values: the
    byte layout is right, so the file below is a real K-quant file, not noise."""
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 0.1, (8, 2 * QK_K)).astype(np.float32)
    for qtype, enc, tol in ((Q.Q4_K, encode_q4_k, 0.05), (Q.Q6_K, encode_q6_k, 0.01)):
        y = decode(enc(x), qtype, x.shape)
        err = np.abs(y - x).max()
        assert err < tol, (qtype.name, err)
        assert np.abs(y - x).mean() < tol / 4, qtype.name


def test_file_holds_every_supported_type(tiny_gguf):
    path, _, _ = tiny_gguf
    reader = gguf.GGUFReader(str(path))
    types = {Q(t.tensor_type).name for t in reader.tensors}
    assert types == set(SUPPORTED_QTYPES)


def test_config_from_metadata(tiny_gguf):
    path, _, _ = tiny_gguf
    cfg, _ = load_gguf(path)
    assert cfg.architecture == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        VOCAB, HIDDEN, INTER, LAYERS)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg.rms_norm_eps == pytest.approx(EPS)
    assert cfg.rope_theta == THETA
    assert cfg.max_position_embeddings == CTX
    assert cfg.tie_word_embeddings is False
    assert cfg.attention_bias is False
    assert cfg.bos_token_id == BOS
    assert cfg.eos_token_ids == (EOS,)
    assert cfg.name == "tiny-llama"


def test_weights_equal_dequantized_reference(tiny_gguf):
    path, state, reference = tiny_gguf
    _, weights = load_gguf(path)
    assert set(weights) == set(reference)
    for name, ref in reference.items():
        got = weights[name]
        assert got.dtype == torch.float32, name
        assert got.shape == ref.shape == state[name].shape, name
        assert torch.equal(got, ref), (name, (got - ref).abs().max().item())
    # and the reference is the model we wrote, up to quantization error (un-permuted rows
    # in the right place: a permuted Q/K would be off by ~the weights' size, 0.08 std)
    for name, ref in reference.items():
        err = (ref - torch.from_numpy(state[name])).abs().max().item()
        assert err < 0.06, (name, err)


def test_q_k_rows_really_permuted_in_file(tiny_gguf):
    """Guard for the test itself: the stored Q/K rows differ from HF order, so the
    un-permutation is exercised."""
    path, state, _ = tiny_gguf
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    hf = state["model.layers.0.self_attn.q_proj.weight"]
    stored = decode(np.asarray(t.data), Q(t.tensor_type), hf.shape)
    assert np.abs(stored - hf).max() > 0.1
    assert np.abs(unpermute_rows(stored, HEADS) - hf).max() < 1e-2


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    path, _, _ = tiny_gguf
    return track(LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                        block_size=4, num_kv_blocks=64,
                                        max_num_batched_tokens=16)))


@torch.inference_mode()
def test_logits_match_transformers_on_dequantized_weights(tiny_gguf, engine):
    from transformers import LlamaForCausalLM

    _, _, reference = tiny_gguf
    hf = LlamaForCausalLM(tiny_hf_config()).eval()
    hf.load_state_dict(reference, strict=True)
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (21,)).tolist()
    ref = hf(torch.tensor([prompt])).logits[0]
    assert ref.abs().max().item() > 1.0  # logits are not trivially small
    for chunks in ([21], [6, 9, 6], [1] * 21):
        ours = our_logits(engine, prompt, chunks)
        diff = (ours - ref).abs().max().item()
        assert diff < 1e-4, (chunks, diff)


@torch.inference_mode()
def test_logits_match_transformers_loading_the_gguf(tiny_gguf, engine):
    """transformers reads the same file itself (its own metadata parsing, dequantization and
    Q/K un-permutation)."""
    from transformers import AutoModelForCausalLM

    path, _, reference = tiny_gguf
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    assert hf.config.vocab_size == VOCAB and hf.config.num_key_value_heads == KV_HEADS
    sd = hf.state_dict()
    for name, ref in reference.items():
        assert torch.equal(sd[name], ref), name
    torch.manual_seed(2)
    prompt = torch.randint(0, VOCAB, (17,)).tolist()
    ref_logits = hf(torch.tensor([prompt])).logits[0]
    ours = our_logits(engine, prompt, [17])
    assert (ours - ref_logits).abs().max().item() < 1e-4


def test_greedy_generation_runs(engine):
    from scheduler.sampling_params import SamplingParams

    outs = engine.generate([[BOS, 7, 300 - 1], [BOS]],
                           SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(o) for o in outs] == [5, 5]
    assert all(0 <= t < VOCAB for o in outs for t in o)
    assert engine.blocks.num_used_blocks == 0


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny-gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported"):
        load_gguf(path)
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported"):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                               num_kv_blocks=8))
