"""``run.py generate``: a tiny random-weight decoder built from the engine's layer and KV cache, run end to end.

The model is small on purpose (it runs on 2 CPU cores); its weights are random, so the tokens mean nothing.
What it shows: prefill (in chunks) and one-token decode through one code path, tokens/s for each phase, the
cache's memory against the KV-cache formula ``2 * layers * B * Hkv * S * D * bytes``, and (``--check``) that
cached greedy decoding picks the same tokens as a full uncached forward pass. ``--kv-dtype int8`` (or ``fp8``)
stores the cache quantized (engine.quantized); ``--check`` then also prints each layer's attention-output error
against a cache in the model's dtype, on one decode step after the same prefill. ``--paged PAGE_SIZE`` serves the
prompts from a PagedKVCache (engine.generate_paged); ``--speculative`` decodes them with a draft tree verified in one
paged call per step (engine.speculative); both check their greedy tokens against this run's. The model
(engine.tiny_decoder):

    ids [B, T] -> embed -> L x (RMSNorm -> MultiHeadAttention (RoPE, GQA, KV cache) -> RMSNorm -> SwiGLU MLP)
               -> RMSNorm -> lm_head -> logits [B, T, V]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn
from tqdm import tqdm

from engine.generate_paged import report_paged
from engine.kv_cache import kv_cache_bytes
from engine.speculative import add_speculative_arguments, check_speculative_arguments, report_speculative
from engine.tiny_decoder import TinyDecoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
KV_DTYPES = {**DTYPES, "int8": torch.int8}  # the cache may be quantized: 1 byte per entry + a scale per token
if hasattr(torch, "float8_e4m3fn"):
    KV_DTYPES["fp8"] = torch.float8_e4m3fn


def left_padded_prompts(batch: int, prompt_len: int, vocab: int, ragged: bool, generator: torch.Generator):
    """Random prompts ``[B, T]``, left-padded when ``ragged`` (row b is shorter by b * T // (2B) tokens).

    Returns ``(ids [B, T], positions [B, T], valid [B, T])``: real tokens count positions from 0.
    """
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=generator)  # [B, T]
    pads = torch.tensor([b * prompt_len // (2 * batch) if ragged else 0 for b in range(batch)])  # [B]
    valid = torch.arange(prompt_len)[None, :] >= pads[:, None]  # [B, T]
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, T]
    return ids.masked_fill(~valid, 0), positions, valid


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model: TinyDecoder, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
             new_tokens: int, chunk: int, capacity: int, progress: bool = True, kv_dtype: torch.dtype | None = None):
    """Greedy decoding: chunked prefill of the prompt, then ``new_tokens`` one-token decode steps; the caches
    hold ``kv_dtype`` (default the model's dtype; int8 / float8_e4m3fn: quantized).

    Returns ``(tokens [B, new_tokens], caches, prefill_seconds, decode_seconds)``.
    """
    batch, prompt_len = ids.shape
    caches = model.new_caches(batch, capacity, kv_dtype)
    device = ids.device
    _sync(device)
    start = time.perf_counter()
    for begin in tqdm(range(0, prompt_len, chunk), desc="prefill", unit="chunk", leave=False, disable=not progress):
        end = min(begin + chunk, prompt_len)
        logits = model(ids[:, begin:end], positions[:, begin:end], caches, valid[:, begin:end])  # [B, t, V]
    token = logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
    _sync(device)
    prefill_seconds = time.perf_counter() - start
    tokens = [token]
    start = time.perf_counter()
    for _ in tqdm(range(new_tokens - 1), desc="decode", unit="tok", leave=False, disable=not progress):
        token = model(token, caches=caches)[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]: positions continue
        tokens.append(token)
    _sync(device)
    return torch.cat(tokens, dim=1), caches, prefill_seconds, time.perf_counter() - start


@torch.no_grad()
def check_against_full_forward(model, ids, positions, valid, tokens) -> tuple[bool, float]:
    """Run prompt + generated tokens in one uncached forward; its greedy picks must be the generated tokens.

    Returns ``(same, margin)``: whether every pick agrees, and the smallest gap between the top logit and the
    runner-up over all steps (a gap far above the dtype's roundoff means the agreement is not luck).
    """
    new = tokens.shape[1]
    all_ids = torch.cat([ids, tokens], dim=1)  # [B, T + N]
    tail = positions[:, -1:] + 1 + torch.arange(new)  # [B, N]
    all_positions = torch.cat([positions, tail.to(positions.device)], dim=1)  # [B, T + N]
    all_valid = torch.cat([valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1)  # [B, T + N]
    logits = model(all_ids, all_positions, None, all_valid)[:, ids.shape[1] - 1:-1].float()  # [B, N, V]
    top2 = logits.topk(2, dim=-1).values  # [B, N, 2]
    return torch.equal(logits.argmax(dim=-1), tokens), (top2[..., 0] - top2[..., 1]).min().item()


@torch.no_grad()
def layer_errors(model, ids, positions, valid, kv_dtype: torch.dtype) -> list[float]:
    """Each layer's attention-output error of a ``kv_dtype`` cache against one in the model's dtype: prefill the
    prompt into both, run one decode step on the same input, return ``max |out - out_ref| / max |out_ref|`` per layer
    (each layer gets the reference's input, so errors do not compound)."""
    batch = ids.shape[0]
    capacity = ids.shape[1] + 1
    reference, quantized = model.new_caches(batch, capacity), model.new_caches(batch, capacity, kv_dtype)
    model(ids, positions, reference, valid)
    model(ids, positions, quantized, valid)
    token = ids[:, -1:]  # [B, 1]
    x = model.embed(token)  # [B, 1, E]
    errors = []
    for block, ref_cache, q_cache in zip(model.blocks, reference, quantized):
        h = block.attn_norm(x)  # [B, 1, E]
        out_ref = block.attn(h, cache=ref_cache)  # [B, 1, E]
        out = block.attn(h, cache=q_cache)  # [B, 1, E]
        error = (out.float() - out_ref.float()).abs().max() / out_ref.float().abs().max().clamp_min(1e-30)
        errors.append(error.item())
        x = x + out_ref.to(x.dtype)  # [B, 1, E]: the next layer sees the reference's stream
        h = block.mlp_norm(x)  # [B, 1, E]
        x = x + block.down(nn.functional.silu(block.gate(h)) * block.up(h))  # [B, 1, E]
    return errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Generate with a tiny random-weight decoder built from engine.layer.MultiHeadAttention "
                          "and engine.kv_cache.KVCache (no download); prints prefill and decode tokens/s and the "
                          "KV cache's memory.")
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="model width E (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="query heads Hq (default 4)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads Hkv; 1 = MQA, Hq = MHA (default 2)")
    parser.add_argument("--head-dim", type=int, default=None, help="head dim D (default hidden // heads)")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    parser.add_argument("--window", type=int, default=None, help="sliding window in keys, own included (default none)")
    parser.add_argument("--batch", type=int, default=4, help="sequences decoded together B (default 4)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per row (default 64)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens to generate per row (default 32)")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk size (default: the whole prompt)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="KV cache slots per row (default prompt-len + new-tokens); too small raises")
    parser.add_argument("--ragged", action="store_true", help="left-pad rows to different prompt lengths")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and cache dtype")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default=None,
                        help="KV cache dtype (default --dtype); int8 / fp8: quantized, a fp32 scale per token and head")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and prompts (default 0)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="compare the greedy tokens with one full uncached forward pass (default on)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (default 1: a tiny model's ops are too small to split, and "
                             "extra threads mostly wait on each other when the cores are shared)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("--paged", type=int, default=None, metavar="PAGE_SIZE",
                        help="also serve the prompts from a PagedKVCache with pages of this many tokens (each row's "
                             "real tokens only, packed) and check its greedy tokens equal the contiguous cache's")
    add_speculative_arguments(parser)


def _describe(args, capacity: int) -> str:
    group = args.heads // args.kv_heads
    kind = "MHA" if group == 1 else "MQA" if args.kv_heads == 1 else f"GQA, G={group}"
    head_dim = args.head_dim or args.hidden // args.heads
    return (f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} query / {args.kv_heads} KV heads "
            f"({kind}), head dim {head_dim}, vocab {args.vocab}, window {args.window or 'none'}, {args.dtype}, "
            f"{args.device} ({args.threads} thread{'s' if args.threads > 1 else ''}); random weights\n"
            f"run: batch {args.batch}, prompt {args.prompt_len} tokens{' (left-padded, ragged)' if args.ragged else ''}"
            f" in chunks of {args.chunk or args.prompt_len}, {args.new_tokens} new tokens, cache capacity {capacity}")


def main(args: argparse.Namespace) -> int:
    if args.new_tokens < 1 or args.prompt_len < 1 or args.batch < 1:
        raise ValueError(f"--new-tokens, --prompt-len and --batch must be >= 1, got {args.new_tokens}, "
                         f"{args.prompt_len}, {args.batch}")
    capacity = args.capacity or args.prompt_len + args.new_tokens
    chunk = args.chunk or args.prompt_len
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    check_speculative_arguments(args)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, capacity, chunk, device, dtype)
    finally:
        torch.set_num_threads(threads_before)  # leave the process as it was (tests call main in-process)


def _run(args: argparse.Namespace, capacity: int, chunk: int, device: torch.device, dtype: torch.dtype) -> int:
    kv_dtype = KV_DTYPES[args.kv_dtype] if args.kv_dtype else None
    torch.manual_seed(args.seed)
    model = TinyDecoder(args.vocab, args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim,
                        args.window).to(device=device, dtype=dtype).eval()
    ids, positions, valid = left_padded_prompts(args.batch, args.prompt_len, args.vocab, args.ragged,
                                                torch.Generator().manual_seed(args.seed))
    ids, positions, valid = ids.to(device), positions.to(device), valid.to(device)
    print(_describe(args, capacity))
    warm_up = min(chunk, args.prompt_len)  # first calls pay one-time costs (allocator, kernel choice): not timed
    generate(model, ids[:, :warm_up], positions[:, :warm_up], valid[:, :warm_up], 2, chunk, warm_up + 2, False)
    try:
        tokens, caches, prefill_s, decode_s = generate(model, ids, positions, valid, args.new_tokens, chunk,
                                                       capacity, progress=not args.no_progress, kv_dtype=kv_dtype)
    except ValueError as error:  # e.g. the KV cache overflow when --capacity is too small
        print(f"error: {error}", file=sys.stderr)
        return 2
    real_prompt = int(valid.sum())
    decoded = args.batch * (args.new_tokens - 1)
    print(f"prefill: {real_prompt} tokens in {prefill_s * 1e3:.1f} ms = {real_prompt / prefill_s:,.0f} tokens/s")
    if decoded:
        print(f"decode:  {decoded} tokens in {decode_s * 1e3:.1f} ms = {decoded / decode_s:,.0f} tokens/s "
              f"({decode_s / (args.new_tokens - 1) * 1e3:.2f} ms per step of {args.batch} tokens)")
    head_dim = caches[0].keys.shape[-1]
    nbytes = sum(cache.nbytes for cache in caches)
    formula = kv_cache_bytes(args.layers, args.batch, args.kv_heads, capacity, head_dim, caches[0].keys.element_size())
    scales = " + scales" if caches[0].quantized else ""
    print(f"KV cache: {args.layers} layers x K,V [{args.batch}, {args.kv_heads}, {capacity}, {head_dim}] "
          f"{args.kv_dtype or args.dtype} = {nbytes:,} B (2*layers*B*Hkv*S*D*bytes = {formula:,} B{scales}); "
          f"positions and validity {sum(c.bookkeeping_nbytes for c in caches):,} B; filled {caches[0].length} slots")
    print(f"row 0 tokens: {tokens[0, :16].tolist()}{' ...' if tokens.shape[1] > 16 else ''}")
    if args.paged and not report_paged(model, ids, valid, tokens, args.new_tokens, args.paged, capacity):
        return 1
    if args.speculative and not report_speculative(model, ids, valid, tokens, args, kv_dtype):
        return 1
    if args.check:
        same, margin = check_against_full_forward(model, ids, positions, valid, tokens)
        print(f"check: cached greedy tokens == full uncached forward: {'yes' if same else 'NO'} "
              f"(smallest top-1/top-2 logit gap {margin:.2e})")
        if caches[0].quantized:
            errors = layer_errors(model, ids, positions, valid, kv_dtype)
            print(f"check: {args.kv_dtype} cache vs {args.dtype} cache, attention output error per layer "
                  f"(max abs / max abs of the reference): {', '.join(f'{e:.2e}' for e in errors)}")
        return 0 if same else 1
    return 0
