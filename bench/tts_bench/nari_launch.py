"""Start nari-qwen3-tts's server on an H200, and optionally compile its FlashInfer kernels ahead.

`nari-qwen3-tts-server` hard-codes `require_h100=True` (nari_qwen3_tts/serve.py), and its loader then refuses any
card whose name lacks "H100" ("production model loading requires H100, got 'NVIDIA H200'"). The H200 is the
H100's chip (compute capability 9.0, the same SM90 kernels, FP8 path included) with more and faster memory, so
`serve` drops only that name check and runs nari's own `main()` with the given arguments, unchanged otherwise.

`prewarm` builds, in parallel processes, the FlashInfer JIT modules nari's start-up would otherwise compile one
after another on first use (paged prefill and decode attention at the 1.7B talker's 16/8 heads of 128, RMS
norms, SiLU-and-mul, top-k/top-p sampling, the SM90 FP8 block-scale GEMM at its gate/up shape). FlashInfer
caches them on disk, so nari's start-up then loads them. Any failure here is logged and left to nari.

    python bench/tts_bench/nari_launch.py serve --model ... --profile ttfa ...   # nari-qwen3-tts-server's flags
    python bench/tts_bench/nari_launch.py prewarm
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor


def serve(argv: list[str]) -> None:
    import nari_qwen3_tts.model.checkpoint as checkpoint
    from nari_qwen3_tts.serve import main

    check = checkpoint._validate_device

    def validate_device(config, device):  # everything but the card's name
        return check(dataclasses.replace(config, require_h100=False), device)

    checkpoint._validate_device = validate_device
    sys.argv = ["nari-qwen3-tts-server", *argv]
    main()


def _attention() -> str:
    import flashinfer
    import torch

    device, bf16, i32 = "cuda", torch.bfloat16, torch.int32
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    kv = torch.randn(2, 2, 128, 8, 128, dtype=bf16, device=device)  # [pages, k/v, page size, kv heads, dim]
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    prefill.plan(qo_indptr=torch.tensor([0, 40], dtype=i32), paged_kv_indptr=torch.tensor([0, 1], dtype=i32),
                 paged_kv_indices=torch.tensor([0], dtype=i32), paged_kv_last_page_len=torch.tensor([40], dtype=i32),
                 num_qo_heads=16, num_kv_heads=8, head_dim_qk=128, page_size=128, causal=True, q_data_type=bf16)
    prefill.run(torch.randn(40, 16, 128, dtype=bf16, device=device), kv)
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    decode.plan(indptr=torch.tensor([0, 1, 2], dtype=i32), indices=torch.tensor([0, 1], dtype=i32),
                last_page_len=torch.tensor([5, 9], dtype=i32), num_qo_heads=16, num_kv_heads=8, head_dim=128,
                page_size=128, q_data_type=bf16)
    decode.run(torch.randn(2, 16, 128, dtype=bf16, device=device), kv)
    return "attention"


def _pointwise() -> str:
    import flashinfer
    import torch

    x = torch.randn(8, 2048, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(2048, dtype=torch.bfloat16, device="cuda")
    flashinfer.norm.rmsnorm(x, w, eps=1e-6)
    flashinfer.norm.fused_add_rmsnorm(x.clone(), x.clone(), w, eps=1e-6)
    flashinfer.activation.silu_and_mul(torch.randn(8, 2 * 6144, dtype=torch.bfloat16, device="cuda"))
    return "norm, activation"


def _sampling() -> str:
    import flashinfer
    import torch

    logits = torch.randn(1, 3072, device="cuda")
    k, p = torch.tensor([50], device="cuda"), torch.tensor([1.0], device="cuda")
    seed, offset = torch.tensor([1], device="cuda"), torch.tensor([0], device="cuda")
    flashinfer.sampling.top_k_top_p_sampling_from_logits(logits, k, p, deterministic=True, seed=seed, offset=offset)
    flashinfer.sampling.top_k_top_p_sampling_from_probs(logits.softmax(-1), k, p, deterministic=True, seed=seed,
                                                        offset=offset)
    return "sampling"


def _fp8_gemm() -> str:
    import torch
    from flashinfer.gemm import fp8_blockscale_gemm_sm90

    weight = torch.randn(2 * 6144, 2048, device="cuda").to(torch.float8_e4m3fn)
    scale = torch.ones(2 * 6144 // 128, 2048 // 128, device="cuda")
    for rows in (1, 8, 32, 64, 128):
        fp8_blockscale_gemm_sm90(torch.randn(rows, 2048, dtype=torch.bfloat16, device="cuda"), weight,
                                 weight_scale=scale, out_dtype=torch.bfloat16)
    return "fp8 block-scale gemm"


def _timed(job) -> str:
    t0 = time.time()
    try:
        return f"{job()}: built in {time.time() - t0:.0f} s"
    except Exception:  # noqa: BLE001 (nari compiles what is missing itself)
        return f"{job.__name__} failed after {time.time() - t0:.0f} s:\n{traceback.format_exc(limit=3)}"


def prewarm() -> None:
    import multiprocessing

    jobs = (_fp8_gemm, _attention, _sampling, _pointwise)  # the longest builds first
    with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(_timed, jobs):
            print(f"[prewarm] {line}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("serve", "prewarm"):
        sys.exit(__doc__)
    serve(sys.argv[2:]) if sys.argv[1] == "serve" else prewarm()
