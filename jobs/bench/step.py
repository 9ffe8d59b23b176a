"""Where a plain decoding step's time goes on a device: one forward (`forward_ms`, the cost profile's number)
against our `ar` loop and transformers' own greedy `generate`, the pieces of a step timed alone, and the
step's operators under torch's profiler (host and device time). On randomly initialised models of the
embedded target's exact config, so nothing is downloaded; the device's host cost per kernel launch and per
attention call is what it exposes.

    python -m jobs.bench.step --device cuda                  # the embedded target's shape, bf16
    python -m jobs.bench.step --device cuda --cudnn-sdpa     # with torch's cuDNN attention left on
    python -m jobs.bench.step --device cpu --tiny            # how it is tested
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, Qwen2Config

from jobs.gpu_check import EMBEDDED_TARGET, TINY, build, host_prompts
from treegraft_dist.decoding.config import TreeConfig
from treegraft_dist.decoding.costs import forward_ms
from treegraft_dist.decoding.engine import Decoder
from treegraft_dist.decoding.sampling import SamplingParams
from treegraft_dist.decoding.stats import synchronize
from treegraft_dist.decoding.verify import TargetVerifier, forward_blocks
from treegraft_dist.models.hf import CUDNN_SDPA_ENV


def timed(device: torch.device, fn, repeats: int) -> tuple[float, float]:
    """(best, median) ms of `fn` over `repeats` calls after one warm-up, the device synchronised around each."""
    fn()
    synchronize(device)
    ms = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        synchronize(device)
        ms.append((time.perf_counter() - t) * 1e3)
    ms.sort()
    return ms[0], ms[len(ms) // 2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the same family (seconds on a CPU)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per end-to-end request")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cudnn-sdpa", action="store_true", help=f"keep cuDNN attention on ({CUDNN_SDPA_ENV}=1)")
    args = ap.parse_args(argv)
    if args.cudnn_sdpa:
        os.environ[CUDNN_SDPA_ENV] = "1"
    device = torch.device(args.device)
    lm = build(Qwen2Config(**(dict(EMBEDDED_TARGET, **TINY) if args.tiny else EMBEDDED_TARGET)), device,
               getattr(torch, args.dtype))
    cudnn = f"; cuDNN attention {'on' if torch.backends.cuda.cudnn_sdp_enabled() else 'off'}" if device.type == "cuda" else ""
    print(f"torch {torch.__version__}, {args.dtype} on {device}{cudnn}")
    prompt = host_prompts(1, lm.vocab_size, 256)[0]
    rows = [("forward_ms, 1 token over 256 cached", (forward_ms(lm, 1, repeats=args.repeats),) * 2),
            ("forward_ms, 16-node tree over 256 cached", (forward_ms(lm, 16, repeats=args.repeats),) * 2)]

    verifier = TargetVerifier(lm, SamplingParams())
    state = {"token": verifier.prefill(prompt, want_prefill_cache=False)[0]}

    def step():
        state["token"] = verifier.step(state["token"])

    rows.append(("TargetVerifier.step (the ar loop's step)", timed(device, step, args.repeats)))
    rows.append(("  its forward alone", timed(device, lambda: forward_blocks(lm, [verifier.step_block(1)]), args.repeats)))
    h = forward_blocks(lm, [verifier.step_block(1)])[0]
    rows.append(("  its logits alone", timed(device, lambda: lm.logits(h), args.repeats)))

    cache = DynamicCache(config=lm.model.config)
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True)
        raw = {"ids": torch.tensor([[5]], device=device)}

        def hf_step():
            with torch.inference_mode():
                out = lm.model(input_ids=raw["ids"], past_key_values=cache, use_cache=True)
                raw["ids"] = out.logits[:, -1:].argmax(-1)

        rows.append(("transformers' own forward (its cache, no mask)", timed(device, hf_step, args.repeats)))
    for label, (best, median) in rows:
        print(f"{label:52s} best {best:8.2f}  median {median:8.2f} ms")

    n = args.tokens
    decoder = Decoder(lm, None, TreeConfig(budget=16))
    decoder.generate(prompt, 4, "ar")
    t = time.perf_counter()
    decoder.generate(prompt, n, "ar")
    ours = time.perf_counter() - t
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        lm.model.generate(ids, max_new_tokens=4, do_sample=False)
        synchronize(device)
        t = time.perf_counter()
        lm.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        synchronize(device)
        theirs = time.perf_counter() - t
    print(f"\n{n} tokens after a 256-token prompt: ar {n / ours:.2f} tok/s, transformers generate {n / theirs:.2f} "
          f"tok/s, ratio {theirs / ours:.2f}x")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(10):
            step()
        synchronize(device)
    print("\n10 ar steps by operator, host time first:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=50))


if __name__ == "__main__":
    main()
