"""PEFT LoRA adapters merged at load (q3tts/models/lora.py): the merged model gives the codes of the official model
with the adapter applied by peft (its own unmerged forward, in the oracle's environment), fp32 and greedy, on a
tiny checkpoint and a random adapter of the talker and the code predictor; every refusal names the module and
shape; `--lora` on say, batch and serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from q3tts import TTS
from q3tts.checkpoint import CheckpointError
from q3tts.cli import main
from q3tts.tiny import write_tiny_checkpoint
from tests.equivalence.test_equivalence import GREEDY, run_ours

TARGETS = ["q_proj", "v_proj", "down_proj", "codec_head"]


def write_adapter(folder: Path, checkpoint: Path, r: int = 4, alpha: float = 8.0, seed: int = 0,
                  include=lambda name: name.startswith("talker."), **config) -> Path:
    """A random PEFT LoRA adapter of `checkpoint`'s TARGETS (B random too: peft's own init makes it zero, a no-op),
    as peft's save_pretrained writes it. `codec_head` gets rank 2 (peft's rank_pattern)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, w in load_file(checkpoint / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if w.dim() != 2 or not include(name) or module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        rank = 2 if module.endswith("codec_head") else r
        weights[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.2
        weights[f"base_model.model.{module}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.2
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": TARGETS, "lora_dropout": 0.0,
        "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
        "rank_pattern": {"codec_head": 2}, "alpha_pattern": {}, "task_type": None, "inference_mode": True,
        "base_model_name_or_path": str(checkpoint), **config}))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lora") / "ckpt", "custom_voice", "0b6", seed=6)


CALL = {"method": "generate_custom_voice",
        "kwargs": {"text": ["Good morning, seven stars.", "Hello there."], "speaker": ["ryan", "vivian"],
                   "language": ["english", "auto"], "max_new_tokens": 10, **GREEDY}}


@pytest.fixture(scope="module")
def official(checkpoint, oracle, tmp_path_factory) -> tuple[Path, dict]:
    """A random adapter and the official model's output with it applied by peft (one oracle process, paid once:
    its imports and start-up are most of its time)."""
    folder = tmp_path_factory.mktemp("peft")
    adapter = write_adapter(folder / "adapter", checkpoint)
    (folder / "calls.json").write_text(json.dumps([CALL]))
    oracle.run("generate.py", checkpoint, folder / "calls.json", folder / "out.pt", adapter)
    return adapter, torch.load(folder / "out.pt", weights_only=False)[0]


def test_merged_codes_equal_peft_on_the_official_model(checkpoint, official, monkeypatch):
    adapter, result = official
    merged = run_ours(TTS.from_pretrained(checkpoint, lora=adapter), CALL, monkeypatch)
    plain = run_ours(TTS.from_pretrained(checkpoint), CALL, monkeypatch)
    for mine, theirs, before in zip(merged["codes"], result["codes"], plain["codes"]):
        assert torch.equal(mine, theirs.cpu())
        assert not torch.equal(mine[: len(before)], before[: len(mine)])  # (the adapter changes the output)


def test_the_merge_is_peft_arithmetic(checkpoint, tmp_path):
    """W + (B @ A) * alpha / r on the modules named, the rest untouched; a code-predictor-only adapter, named
    relative to the talker (peft wrapped the talker alone)."""
    adapter = write_adapter(tmp_path / "cp", checkpoint, include=lambda n: ".code_predictor." in n)
    weights = load_file(adapter / "adapter_model.safetensors")
    renamed = {k.replace("base_model.model.talker.", "base_model.model."): v for k, v in weights.items()}
    save_file(renamed, adapter / "adapter_model.safetensors")
    base, merged = TTS.from_pretrained(checkpoint), TTS.from_pretrained(checkpoint, lora=adapter)
    before, after = base.model.state_dict(), merged.model.state_dict()
    name = "talker.code_predictor.model.layers.0.self_attn.q_proj.weight"
    prefix = "base_model.model.code_predictor.model.layers.0.self_attn.q_proj"
    a, b = renamed[prefix + ".lora_A.weight"], renamed[prefix + ".lora_B.weight"]
    assert torch.equal(after[name], before[name] + (b @ a) * 2.0)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".code_predictor." in k for k in changed)


def _refused(checkpoint: Path, adapter: Path, *says: str) -> None:
    with pytest.raises(CheckpointError) as e:
        TTS.from_pretrained(checkpoint, lora=adapter)
    assert all(s in str(e.value) for s in says), str(e.value)


def test_refusals_name_the_module_and_shape(checkpoint, tmp_path):
    adapter = write_adapter(tmp_path / "unknown", checkpoint)
    weights = load_file(adapter / "adapter_model.safetensors")
    weights["base_model.model.talker.model.layers.0.self_attn.x_proj.lora_A.weight"] = torch.zeros(4, 64)
    weights["base_model.model.talker.model.layers.0.self_attn.x_proj.lora_B.weight"] = torch.zeros(64, 4)
    save_file(weights, adapter / "adapter_model.safetensors")
    _refused(checkpoint, adapter, "module talker.model.layers.0.self_attn.x_proj, which this model does not have")

    adapter = write_adapter(tmp_path / "targets", checkpoint, target_modules=["q_proj", "x_proj"])
    _refused(checkpoint, adapter, "target_modules ['x_proj'] name no linear layer")

    adapter = write_adapter(tmp_path / "rank", checkpoint, r=4, rank_pattern={"codec_head": 3})
    _refused(checkpoint, adapter, "module talker.codec_head: rank mismatch: lora_A [2, 64], lora_B [3072, 2], the "
                                  "config's rank 3")

    large = write_tiny_checkpoint(tmp_path / "large", "custom_voice", "1b7", seed=6)
    adapter = write_adapter(tmp_path / "other-size", large)
    _refused(checkpoint, adapter, "is [", "in this model, the adapter's lora_A", "an adapter for another model size")

    adapter = write_adapter(tmp_path / "dora", checkpoint, use_dora=True)
    _refused(checkpoint, adapter, "use_dora is set")
    _refused(checkpoint, tmp_path, "not a LoRA adapter folder")


def test_lora_flag_on_say_and_batch(checkpoint, tmp_path, capsys):
    adapter = write_adapter(tmp_path / "adapter", checkpoint)
    outs = []
    for flags in ([], ["--lora", str(adapter)]):
        out = tmp_path / f"say{len(flags)}.wav"
        assert main(["say", "Hello.", "--model", str(checkpoint), *flags, "-o", str(out), "--max-new-tokens", "4",
                     "--greedy"]) == 0
        outs.append(sf.read(out)[0])
    assert outs[0].shape == outs[1].shape and not (outs[0] == outs[1]).all()
    (tmp_path / "jobs.jsonl").write_text(json.dumps({"text": "Hello.", "speaker": "ryan", "id": "a",
                                                     "max_new_tokens": 4, "do_sample": False,
                                                     "subtalker_dosample": False}) + "\n")
    assert main(["batch", str(tmp_path / "jobs.jsonl"), "--out-dir", str(tmp_path / "out"), "--model",
                 str(checkpoint), "--lora", str(adapter)]) == 0
    assert (sf.read(tmp_path / "out" / "a.wav")[0] == outs[1]).all()
    assert main(["say", "Hello.", "--model", str(checkpoint), "--lora", str(tmp_path), "-o",
                 str(tmp_path / "x.wav")]) == 1
    assert "not a LoRA adapter folder" in capsys.readouterr().err


def test_serve_passes_lora_to_its_engine_processes():
    from q3tts.server import ServerConfig
    from q3tts.server.front.app import engine_args

    args = [str(a) for a in engine_args(ServerConfig(model="tiny", lora="me/adapter"), "info")]
    assert args[args.index("--lora") + 1] == "me/adapter"
