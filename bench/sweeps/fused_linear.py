"""Tile shapes for the decode steps' fused matrix products (linear.fused_linear): every product shape of a
model's talker and code predictor layers (each shape once), for 1, 2 and 64 rows, timed with each candidate
(BLOCK_N, BLOCK_K, warps, stages; the tensor-core kernel's K ranges too) against what it replaces (cuBLAS plus
the norm / SwiGLU / residual-add kernels around it; beyond 16 rows wider column blocks and the K columns split
among several programs). One row takes the matrix-vector kernel (GEMV_TILES), two rows the same kernel with its
own table (GEMV_TWO_ROW_TILES; the tensor-core kernel with its committed tiles is timed beside both as `dot`), more
rows the tensor-core kernel (FUSED_LINEAR_TILES). Prints the best per shape, its bandwidth, and the tables to paste
(`--out`: also as JSON, [table, key, tiles] per entry). GPU machine only.

The weights are read from memory as in a frame, not from L2: each timed call reads the next of enough copies to
overflow L2 (a frame streams ~5 GB of weights through a 50 MB L2; the code predictor's 4-12 MB matrices would
otherwise stay there between the timed calls, and tiles chosen that way favour L2 over DRAM).

usage: python bench/sweeps/fused_linear.py [--sizes 0.6B-Base,1.7B-Base] [--batches 1,2,64] [--out tiles.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from q3tts.benchmarks.common import graph_ms
from q3tts.kernels import activation, linear, norm

CANDIDATES = [(bn, bk, w, s, 1) for bn, bk, (w, s) in
              itertools.product((16, 32, 64), (64, 128, 256), ((4, 3), (4, 5), (8, 3)))]
# Beyond 16 rows the input tile is as large as the weight tile at 64 columns: wider column blocks, and the K
# columns split among up to 8 programs so that a shape's few column blocks still reach every SM
WIDE_CANDIDATES = [(bn, bk, w, s, split) for bn, bk, (w, s), split in
                   itertools.product((32, 64, 128), (64, 128), ((4, 3), (8, 3)), (1, 2, 4, 8))]
GEMV_CANDIDATES = [(bn, bk, w, s) for bn, bk, (w, s) in
                   itertools.product((1, 2, 4, 8), (256, 512, 1024), ((4, 2), (4, 4), (8, 3)))]
# Two rows hold two accumulators per tile: K tiles down to 128, the stage counts that fit
GEMV_TWO_ROW_CANDIDATES = [(bn, bk, w, s) for bn, bk, (w, s) in
                           itertools.product((1, 2, 4, 8), (128, 256, 512), ((4, 2), (8, 2)))]
TABLES = {1: "GEMV_TILES", 2: "GEMV_TWO_ROW_TILES"}  # rows -> the kernels table they take (more: FUSED_LINEAR_TILES)
CONFIGS = Path(__file__).resolve().parents[1] / "q3tts/configs"
COLD_BYTES = 128 * 2**20  # weight copies per shape: at least this much, 2.5x an H100's L2


def time_ms(fn) -> float:
    """GPU ms per call: 20 calls captured in one CUDA graph (as the engine runs them), replayed 5 times; inf for
    a tile that does not fit (out of shared memory or registers), printed."""
    try:
        return graph_ms(fn, replays=5, reps=20)
    except Exception as e:  # (triton's OutOfResources, or a launch that fails with it)
        print(f"  {type(e).__name__}: {str(e)[:120]}")
        return float("inf")


def shapes(size: str, parts: str = "layers,heads") -> list[tuple[str, int, int, str]]:
    """(name, N, K, kind) of each product of a decoder layer, talker and code predictor, and of the heads (each
    shape once: the 0.6B talker's layers have the code predictor's shapes)."""
    talker = json.loads((CONFIGS / f"{size}.json").read_text())["talker_config"]
    cp = talker["code_predictor_config"]
    out = []
    for part, c in (("talker", talker), ("cp", cp)) if "layers" in parts else ():
        h, d, i = c["hidden_size"], c["head_dim"], c["intermediate_size"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        out += [(f"{part} qkv", (heads + 2 * kv) * d, h, "norm"), (f"{part} o", h, heads * d, "residual"),
                (f"{part} gate_up", 2 * i, h, "swiglu"), (f"{part} down", h, i, "residual")]
    if "heads" in parts:  # fp32 logits; the code predictor's head norms its input (runner.head_logits)
        out += [("talker head", talker["vocab_size"], talker["hidden_size"], "head"),
                ("cp head", cp["vocab_size"], cp["hidden_size"], "head_norm")]
    return list({shape[1:]: shape for shape in reversed(out)}.values())[::-1]


def rotating(calls: list):
    """One of `calls` (the same product on each weight copy), the next one each time (the module docstring says
    why)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def unfused(x, w, norm_w, residual, kind):
    """What fused_linear replaces: the separate kernels (each add+RMSNorm counted once, with the product after it)."""
    if kind == "norm":
        return lambda: F.linear(norm.add_rmsnorm(residual, None, norm_w, 1e-6, w.dtype)[0], w)
    if kind == "swiglu":
        return lambda: activation.silu_mul(F.linear(norm.add_rmsnorm(residual, None, norm_w, 1e-6, w.dtype)[0], w))
    if kind == "head":
        return lambda: torch.mm(x, w.t(), out_dtype=torch.float32)
    if kind == "head_norm":
        return lambda: torch.mm(norm.add_rmsnorm(residual, None, norm_w, 1e-6, w.dtype)[0], w.t(),
                                out_dtype=torch.float32)
    return lambda: F.linear(x, w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.6B-Base,1.7B-Base")
    parser.add_argument("--batches", default="1,2,64")
    parser.add_argument("--parts", default="layers,heads", help="layers, heads or both")
    parser.add_argument("--out", type=Path, help="also write the tables here as JSON: [[table, key, tiles], ...]")
    args = parser.parse_args()
    torch.manual_seed(0)
    table = {}
    for size in args.sizes.split(","):
        for M in (int(b) for b in args.batches.split(",")):
            total = {"unfused": 0.0, "default": 0.0, "best": 0.0}
            for name, N, K, kind in shapes(size, args.parts):
                w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
                out_n = N // 2 if kind == "swiglu" else N
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                res_in = torch.randn(M, K, device="cuda")
                res_out = torch.randn(M, out_n, device="cuda")
                norm_w = torch.ones(K if kind != "residual" else out_n, device="cuda", dtype=torch.bfloat16)
                copies = [w] + [w.clone() for _ in range(-(-COLD_BYTES // w.nbytes) - 1)]
                # what each kind's product takes beside its weights (the residual and plain heads the bf16 x, the
                # others the fp32 residual stream they norm)
                inputs = x if kind in ("residual", "head") else res_in
                fused_kwargs = {"residual": dict(residual=res_out), "head": dict(fp32_out=True),
                                "head_norm": dict(norm=norm_w, eps=1e-6, fp32_out=True),
                                "norm": dict(norm=norm_w, eps=1e-6),
                                "swiglu": dict(norm=norm_w, eps=1e-6, swiglu=True)}[kind]
                gemv = M <= linear.GEMV_MAX_ROWS
                extra = {}  # (the tensor-core kernel's norms take their sums of squares as the decoder hands them on)
                if not gemv and "norm" in fused_kwargs:
                    extra = dict(squares=linear.row_squares(res_in))
                elif not gemv and kind == "residual":
                    extra = dict(squares_out=True)
                fused = rotating([functools.partial(linear.fused_linear, inputs, c, **fused_kwargs, **extra)
                                  for c in copies])
                base = rotating([unfused(x, c, norm_w, res_in, kind) for c in copies])
                ref = linear.fused_linear_ref(inputs, w, fused_kwargs.get("norm"), 1e-6,
                                               fused_kwargs.get("swiglu", False), fused_kwargs.get("residual"),
                                               fused_kwargs.get("fp32_out", False))
                t_base, t_default = time_ms(base), time_ms(fused)
                if gemv:  # the tensor-core kernel this replaces, with its committed tiles
                    with mock.patch.object(linear, "GEMV_MAX_ROWS", 0):
                        t_dot = time_ms(fused)
                        total["dot"] = total.get("dot", 0.0) + t_dot
                    key = (out_n, K, kind == "swiglu")
                else:
                    key = (min(linear.FUSED_BLOCK_M, max(16, 1 << (M - 1).bit_length())), out_n, K, kind == "swiglu")
                table_name = TABLES.get(M, "FUSED_LINEAR_TILES")
                swept = getattr(linear, table_name)
                results = []
                candidates = CANDIDATES if M <= 16 else WIDE_CANDIDATES
                for tiles in (GEMV_CANDIDATES if M == 1 else GEMV_TWO_ROW_CANDIDATES) if gemv else candidates:
                    if tiles[1] * (1 if gemv else tiles[4]) > K:
                        continue
                    swept[key] = tiles
                    results.append((time_ms(fused), tiles))
                best, tiles = min(results)
                swept[key] = tiles
                table[(table_name, *key)] = tiles
                out = fused()
                out = out[0] if isinstance(out, tuple) else out
                err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
                gb = N * K * 2 / 1e9
                dot = f"dot {t_dot * 1e3:6.1f} us, " if gemv else ""
                print(f"{size} M={M} {name:<14} N={N:>5} K={K:>5}: unfused {t_base * 1e3:6.1f} us, fused default "
                      f"{t_default * 1e3:6.1f} us, {dot}best {best * 1e3:6.1f} us {tiles} "
                      f"({gb / best * 1e3:5.0f} GB/s) err {err:.1e}", flush=True)
                total["unfused"] += t_base
                total["default"] += t_default
                total["best"] += best
            print(f"{size} M={M} sum over these shapes: " +
                  ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in total.items()), flush=True)
    for name in (*TABLES.values(), "FUSED_LINEAR_TILES"):
        print(name + " = {")
        for key, tiles in sorted(table.items()):
            if key[0] == name:
                print(f"    {key[1:]}: {tiles},")
        print("}")
    if args.out:
        args.out.write_text(json.dumps([[key[0], list(key[1:]), list(tiles)] for key, tiles in sorted(table.items())]))


if __name__ == "__main__":
    main()
