"""bench/scale_out.py, the 1-GPU vs N-GPU capacity run, works end to end before it spends GPU time: here on the
CPU, a tiny Base model with EOS disabled (fixed lengths, as the GPU run's checkpoints), one engine then two."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from safetensors.torch import load_file, save_file  # noqa: E402

from q3tts.tiny import tiny_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow(reason="two servers started, loaded and stopped (tests/SLOW.md)")
def test_scale_out_measures_one_engine_then_two(tmp_path):
    model = shutil.copytree(tiny_checkpoint("tiny-base", tmp_path / "cache"), tmp_path / "no-eos")
    tensors = load_file(model / "model.safetensors")
    eos = json.loads((model / "config.json").read_text())["talker_config"]["codec_eos_token_id"]
    tensors["talker.codec_head.weight"][eos] = 0
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "result.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "scale_out.py"), "--model", str(model), "--one", "cpu",
         "--many", "cpu,cpu", "--rates-one", "1", "--rates-many", "1", "--duration", "2", "--warmup", "0",
         "--clients", "2", "--ttfa-ms", "60000",
         "--serve-flags", "--max-running 4 --log-level warning --no-runaway-guard",
         "--logs", str(tmp_path), "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["gpus"] for r in doc["results"]] == [1, 2] and doc["card"] == "cpu"
    assert all(r["benchmark"] == "serving" and r["requests"] > 0 and r["audio_s_per_s"] > 0 for r in doc["results"])
    assert doc["capacity"]["capacity_rps"] == {"1": 1.0, "2": 1.0} and doc["capacity"]["ratio"] == 1.0
