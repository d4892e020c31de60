"""Faithfulness of the bf16 fast path on the GPU, by teacher forcing (GPU machine only).

For a checkpoint (random full-size weights, e.g. built by the peer harness) and one x-vector voice-clone
request, a token history of `--frames` frames is generated with our fp32 reference on the GPU. Then, fed
that same history, four implementations give raw talker and code-predictor logits:
  * ref_cpu:   our fp32 reference on the CPU
  * ref_gpu:   our fp32 reference on the GPU           (must be within 1e-4 of ref_cpu)
  * q3tts_bf16: our bf16 fast path (the graph kernels)  (must be at least as close to ref_gpu as ...)
  * official_bf16: the official implementation in bf16 (qwen-tts-hf, transformers 5, sdpa)
For each, per decode step: relative error max|l - l_ref| / max|l_ref| and top-1 agreement with ref_gpu,
reported as distributions (median, p90, p99, max), talker and code predictor separately.

usage: python bench/faithfulness.py CKPT_DIR [CKPT_DIR ...] --out faithfulness.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from q3tts.benchmarks.random_model import random_prompt_ids
from q3tts.config import ModelConfig
from q3tts.engine import EngineConfig
from q3tts.engine.runner.model_runner import ModelRunner
from q3tts.models.qwen3_tts import Qwen3TTSModel
from q3tts.reference import generate_codes
from q3tts.request.prompt import PromptSpec, build_prompt
from q3tts.sampling import SamplingParams
from q3tts.teacher_forcing import teacher_forced_logits


def load_peer_harness(path: Path = Path(".peers/peer_bench.py")):
    """The peer harness's module (it is not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location("peer_bench", path.resolve())
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stats(errors: torch.Tensor) -> dict:
    q = torch.quantile(errors.float(), torch.tensor([0.5, 0.9, 0.99]))
    return {"median": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "max": float(errors.max())}


def compare(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    """logits/ref: [steps, V] or [steps, groups, V]; one error per (step, group) row."""
    a, b = logits.float().cpu().reshape(-1, logits.shape[-1]), ref.float().cpu().reshape(-1, ref.shape[-1])
    rel = (a - b).abs().amax(-1) / b.abs().amax(-1)
    return {"rel_error": stats(rel), "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "rows": a.shape[0]}


def load(folder: Path, device: str, dtype: torch.dtype) -> Qwen3TTSModel:
    """With the EOS row zeroed (as the peer harness's checkpoints already are), so the history has fixed length."""
    model = Qwen3TTSModel.from_folder(folder, ModelConfig.from_file(folder / "config.json"), device, dtype)
    model.talker.codec_head.weight.data[model.config.talker_config.codec_eos_token_id] = 0
    return model


def spec_for(config: ModelConfig, embedding: torch.Tensor) -> PromptSpec:
    return PromptSpec(input_ids=random_prompt_ids(config, 24, seed=3), language="english", non_streaming_mode=False,
                      speaker_embedding=embedding)


def official_logits(folder: Path, spec: PromptSpec, codes: torch.Tensor, embedding: torch.Tensor):
    """The official implementation in bf16 on the GPU, teacher-forced with the same history."""
    peer_bench = load_peer_harness()
    peer_bench.patch_qwen_tts_rope_compat()
    from qwen_tts import Qwen3TTSModel as Official

    tts = Official.from_pretrained(str(folder), device_map="cuda:0", dtype=torch.bfloat16, attn_implementation="sdpa")
    model, talker = tts.model, tts.model.talker
    captured = {}

    def grab(_m, _args, kwargs):
        if kwargs.get("inputs_embeds") is not None and kwargs["inputs_embeds"].shape[1] > 1:
            captured.update(embeds=kwargs["inputs_embeds"], trailing=kwargs["trailing_text_hidden"],
                            pad=kwargs["tts_pad_embed"])

    hook = talker.register_forward_pre_hook(grab, with_kwargs=True)
    prompt = {"ref_code": [None], "ref_spk_embedding": [embedding.to("cuda", torch.bfloat16)],
              "x_vector_only_mode": [True], "icl_mode": [False]}
    with torch.no_grad():
        model.generate(input_ids=[torch.tensor([spec.input_ids], device="cuda")], voice_clone_prompt=prompt,
                       languages=["english"], non_streaming_mode=False, max_new_tokens=2, do_sample=False,
                       subtalker_dosample=False)
        hook.remove()
        codes = codes.to("cuda")
        T = codes.shape[0]
        parts = [talker.get_input_embeddings()(codes[:, :1])]
        parts += [talker.code_predictor.get_input_embeddings()[i](codes[:, i + 1:i + 2]) for i in range(15)]
        frames = torch.cat(parts, dim=1).sum(1)  # [T, H], summed as the official decode step does
        trailing = captured["trailing"][0]
        text = torch.cat([trailing, captured["pad"][0].expand(max(T - trailing.shape[0], 0), -1)])[:T]
        x = torch.cat([captured["embeds"], (frames + text)[None]], dim=1)
        hidden = talker.model(inputs_embeds=x, use_cache=False).last_hidden_state[0]
        L = captured["embeds"].shape[1]
        talker_logits = talker.codec_head(hidden[L - 1:]).float()
        cp_logits, _ = talker.forward_sub_talker_finetune(codes, hidden[L - 1:L - 1 + T])
    del tts
    torch.cuda.empty_cache()
    return talker_logits, cp_logits.float()


def measure(folder: Path, frames: int, fused_decode: str = EngineConfig.fused_decode) -> dict:
    ref_gpu = load(folder, "cuda", torch.float32)
    embedding = torch.randn(ref_gpu.config.talker_config.hidden_size, generator=torch.Generator().manual_seed(1))
    spec = spec_for(ref_gpu.config, embedding)
    prompt = build_prompt(ref_gpu.talker, ref_gpu.config, spec)
    codes = generate_codes(ref_gpu.talker, [prompt], [SamplingParams(max_new_tokens=frames + 1, seed=7)])[0]
    results = {"checkpoint": str(folder), "frames": int(codes.shape[0]), "fused_decode": fused_decode}
    gpu = teacher_forced_logits(ref_gpu.talker, prompt, codes)
    del ref_gpu
    ref_cpu = load(folder, "cpu", torch.float32)
    cpu = teacher_forced_logits(ref_cpu.talker, build_prompt(ref_cpu.talker, ref_cpu.config, spec), codes)
    del ref_cpu
    results["ref_gpu_vs_ref_cpu"] = {"talker": compare(gpu[0], cpu[0]), "code_predictor": compare(gpu[1], cpu[1])}
    fast = load(folder, "cuda", torch.bfloat16)
    runner = ModelRunner(fast, EngineConfig(max_rows=64, max_context=512, max_trailing=64,
                                            fused_decode=fused_decode))
    ours = runner.teacher_forced_logits(build_prompt(fast.talker, fast.config, spec), codes)
    del runner, fast
    torch.cuda.empty_cache()
    results["q3tts_bf16_vs_ref_gpu"] = {"talker": compare(ours[0], gpu[0]), "code_predictor": compare(ours[1], gpu[1])}
    try:
        official = official_logits(folder, spec, codes, embedding)
        results["official_bf16_vs_ref_gpu"] = {"talker": compare(official[0], gpu[0]),
                                               "code_predictor": compare(official[1], gpu[1])}
    except Exception as e:  # report what was measured even if the peer package breaks
        import traceback

        traceback.print_exc()
        results["official_bf16_vs_ref_gpu"] = {"error": repr(e)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", type=Path, nargs="+")
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--fused-decode", default=EngineConfig.fused_decode, help="EngineConfig.fused_decode")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {"card": torch.cuda.get_device_name(),
              "results": [measure(f, args.frames, args.fused_decode) for f in args.checkpoints]}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
