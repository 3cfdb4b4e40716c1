"""Engine vs Hugging Face transformers `generate`, same weights, same dtype, one run.

    python -m workers.benchmark [--dtypes float32,bfloat16] [--batches 1,8,32,64]
                                [--prompt-tokens 128] [--output-tokens 128] [--out DIR]

Each (system, dtype) runs in its own subprocess so peak RSS is its own; batches run in
ascending order, so a row's peak RSS is the process peak up to and including that batch.
Prompts are random token ids; decoding is greedy with EOS ignored (transformers:
min_new_tokens), so every request produces exactly --output-tokens tokens.

prefill tok/s: prompt tokens / time to the first token of every request.
decode tok/s:  batch x (output tokens - 1) / time from there to the last token.
ms/step:       that decode time / (output tokens - 1).
The batch-1 floor is weight bytes / memcpy bandwidth measured here (bytes copied per second).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM: reset at exec, unlike ru_maxrss after a fork)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def copy_bandwidth(nbytes: int = 512 * 2**20, reps: int = 5) -> float:
    """Bytes copied per second by a large memcpy (each byte read once and written once)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def prompts_for(batch: int, prompt_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, prompt_tokens), generator=g).tolist()


def run_engine(dtype: str, batches: list[int], pt: int, ot: int) -> list[dict]:
    from scheduler.sampling_params import SamplingParams
    from workers.engine import EngineConfig, LLMEngine

    need = max(batches) * (pt + ot) * 2 * 30 * 3 * 64 * 4 + 2**24  # worst case: float32
    eng = LLMEngine(EngineConfig(dtype=dtype, kv_cache_memory=need, max_num_seqs=max(batches),
                                 max_num_batched_tokens=2048))
    rows = []
    params = SamplingParams(max_tokens=ot, temperature=0.0, ignore_eos=True)
    warm = prompts_for(2, 16, eng.model_config.vocab_size, seed=99)
    eng.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for b in batches:
        prompts = prompts_for(b, pt, eng.model_config.vocab_size)
        for i, p in enumerate(prompts):
            eng.add_request(f"b{b}-{i}", p, params)
        t0 = time.perf_counter()
        first: set[str] = set()
        while len(first) < b:
            first |= {o.request_id for o in eng.step()}
        t1 = time.perf_counter()
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        t2 = time.perf_counter()
        assert steps == ot - 1, steps
        rows.append(dict(system="splitserve", dtype=dtype, batch=b, prefill_s=t1 - t0,
                         decode_s=t2 - t1, steps=steps, peak_rss_mib=peak_rss_mib(),
                         # the model's size (what one decode step must read), not what is
                         # held: a tied LM head kept in a second layout is still read once
                         weight_bytes=eng.model_config.num_params()
                         * torch.finfo(eng.dtype).bits // 8))
        assert eng.blocks.num_used_blocks == 0
    return rows


@torch.inference_mode()
def run_hf(dtype: str, batches: list[int], pt: int, ot: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from workers.loaders.resolve import default_gguf_path

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=getattr(torch, dtype)).eval()
    vocab = model.config.vocab_size
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def gen(ids, n):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)

    gen(torch.tensor(prompts_for(2, 16, vocab, seed=99)), 4)
    rows = []
    for b in batches:
        ids = torch.tensor(prompts_for(b, pt, vocab))
        t0 = time.perf_counter()
        gen(ids, 1)
        t1 = time.perf_counter()
        gen(ids, ot)
        t2 = time.perf_counter()
        prefill = t1 - t0
        rows.append(dict(system="transformers", dtype=dtype, batch=b, prefill_s=prefill,
                         decode_s=(t2 - t1) - prefill, steps=ot - 1,
                         peak_rss_mib=peak_rss_mib(), weight_bytes=wbytes))
    return rows


def child(args) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    fn = run_engine if args.child_system == "splitserve" else run_hf
    rows = fn(args.child_dtype, args.batch_list, args.prompt_tokens, args.output_tokens)
    print("ROWS " + json.dumps(rows), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--systems", default="splitserve,transformers")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--child-system", help=argparse.SUPPRESS)
    ap.add_argument("--child-dtype", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.batch_list = sorted(int(x) for x in args.batches.split(","))
    if args.output_tokens < 2:
        ap.error("--output-tokens must be at least 2")
    if args.child_system:
        return child(args)

    rows: list[dict] = []
    for dtype in args.dtypes.split(","):
        for system in args.systems.split(","):
            cmd = [sys.executable, "-m", "workers.benchmark", "--child-system", system,
                   "--child-dtype", dtype, "--batches", args.batches,
                   "--prompt-tokens", str(args.prompt_tokens),
                   "--output-tokens", str(args.output_tokens)]
            print(f"running {system} {dtype} ...", file=sys.stderr, flush=True)
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = [x for x in out.stdout.splitlines() if x.startswith("ROWS ")]
            if out.returncode != 0 or not line:
                sys.stderr.write(out.stderr[-4000:])
                raise SystemExit(f"{system} {dtype} failed (exit {out.returncode})")
            rows += json.loads(line[0][5:])
    bw = copy_bandwidth()
    pt = args.prompt_tokens
    for r in rows:
        r["prefill_tok_s"] = r["batch"] * pt / r["prefill_s"]
        r["decode_tok_s"] = r["batch"] * r["steps"] / r["decode_s"]
        r["ms_per_step"] = 1000 * r["decode_s"] / r["steps"]
    ref = {(r["dtype"], r["batch"]): r for r in rows if r["system"] == "transformers"}
    for r in rows:
        h = ref.get((r["dtype"], r["batch"]))
        if h is not None and r["system"] != "transformers":
            r["prefill_ratio"] = r["prefill_tok_s"] / h["prefill_tok_s"]
            r["decode_ratio"] = r["decode_tok_s"] / h["decode_tok_s"]
        if r["batch"] == 1:
            r["floor_ms"] = 1000 * r["weight_bytes"] / bw

    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 dequantized), {pt} prompt + "
          f"{args.output_tokens} output tokens, greedy, EOS ignored, "
          f"{torch.get_num_threads()} threads; memcpy bandwidth {bw / 1e9:.1f} GB/s\n")
    hdr = ("| system | dtype | batch | prefill tok/s | decode tok/s | ms/step | peak RSS MiB "
           "| prefill x HF | decode x HF | floor ms (b=1) |")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in sorted(rows, key=lambda r: (r["dtype"] != "float32", r["batch"], r["system"])):
        print(f"| {r['system']} | {r['dtype']} | {r['batch']} | {r['prefill_tok_s']:.0f} | "
              f"{r['decode_tok_s']:.1f} | {r['ms_per_step']:.1f} | {r['peak_rss_mib']:.0f} | "
              + (f"{r['prefill_ratio']:.2f} | {r['decode_ratio']:.2f} | "
                 if "decode_ratio" in r else "- | - | ")
              + (f"{r['floor_ms']:.1f} |" if "floor_ms" in r else "- |"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "engine.json").write_text(json.dumps(
        dict(copy_bandwidth_bytes_s=bw, prompt_tokens=pt, output_tokens=args.output_tokens,
             rows=rows), indent=2))
    print(f"\nwrote {out_dir / 'engine.json'}")


if __name__ == "__main__":
    main()
