"""Fine-tuned checkpoints in the layout the official `finetuning/sft_12hz.py` writes: the Base checkpoint's folder
copied, its config made `custom_voice` with the new speaker at codec row 3000 (`talker_config.spk_id`,
`spk_is_dialect`), the speaker encoder's weights dropped and the speaker's embedding written into
`talker.model.codec_embedding.weight[3000]`. Against the official package (fp32, greedy: identical codes), and in
every entry point: Python, the CLI, HTTP (`/v1/models` lists the speaker), from a folder or a hub id."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from q3tts import TTS
from q3tts.cli import main
from q3tts.server import ServerConfig
from q3tts.tiny import write_tiny_checkpoint
from tests.equivalence.test_equivalence import GREEDY, run_ours, speech_like
from tests.server.harness import FRAME, ServerThread

SPEAKER = "narrator_x"
SFT_ROW = 3000  # where sft_12hz.py writes the new speaker


def write_sft_checkpoint(base: Path, out: Path, speaker: str, embedding: torch.Tensor) -> Path:
    """What sft_12hz.py saves after training (the training itself left out: the weights are the Base's)."""
    shutil.copytree(base, out, dirs_exist_ok=True)
    config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    config["tts_model_type"] = "custom_voice"
    config["talker_config"]["spk_id"] = {speaker: SFT_ROW}
    config["talker_config"]["spk_is_dialect"] = {speaker: False}
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    state = {k: v for k, v in load_file(base / "model.safetensors").items() if not k.startswith("speaker_encoder")}
    weight = state["talker.model.codec_embedding.weight"]
    weight[SFT_ROW] = embedding.to(weight.dtype)
    save_file(state, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    base = write_tiny_checkpoint(root / "base", "base", "0b6", seed=11)
    voice = TTS.from_pretrained(base).create_voice((speech_like(1.5, 24000, 8), 24000), x_vector_only=True)
    return write_sft_checkpoint(base, root / "finetuned", SPEAKER, voice.ref_spk_embedding)


@pytest.fixture(scope="module")
def tts(sft) -> TTS:
    return TTS.from_pretrained(sft)


CALL = {"method": "generate_custom_voice",
        "kwargs": {"text": ["Good morning, seven stars.", "Hello there."], "speaker": [SPEAKER, SPEAKER],
                   "language": ["english", "auto"], "max_new_tokens": 10, **GREEDY}}


@pytest.fixture(scope="module")
def official(sft, oracle, tmp_path_factory) -> dict:
    """The official package's output on the fine-tune (one oracle process, paid once: its imports and start-up
    are most of its time)."""
    folder = tmp_path_factory.mktemp("official")
    (folder / "calls.json").write_text(json.dumps([CALL]))
    oracle.run("generate.py", sft, folder / "calls.json", folder / "out.pt")
    return torch.load(folder / "out.pt", weights_only=False)[0]


def test_the_new_speaker_gives_the_official_codes(tts, official, monkeypatch):
    ours = run_ours(tts, CALL, monkeypatch)
    assert len(ours["codes"]) == len(official["codes"]) == 2
    for mine, theirs in zip(ours["codes"], official["codes"]):
        assert mine.shape == theirs.shape and torch.equal(mine, theirs.cpu())
    assert tts.get_supported_speakers() == [SPEAKER] and tts.config.tts_model_type == "custom_voice"


def test_from_a_hub_id(sft, tmp_path):
    """A fine-tune published on the hub: its snapshot in the huggingface_hub cache layout, read offline."""
    commit = "0" * 40
    repo = tmp_path / "models--someone--tiny-sft"
    shutil.copytree(sft, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    tts = TTS.from_pretrained("someone/tiny-sft", cache_dir=tmp_path, local_files_only=True)
    assert tts.get_supported_speakers() == [SPEAKER]


def test_the_speaker_on_the_command_line(sft, tmp_path, capsys):
    for flags in (["--speaker", "Narrator_X"], []):  # (without --speaker: the checkpoint's own first speaker)
        out = tmp_path / "x.wav"
        assert main(["say", "Hello.", "--model", str(sft), *flags, "-o", str(out), "--max-new-tokens", "4",
                     "--seed", "1"]) == 0
        assert sf.info(out).frames == 3 * FRAME and f"speaker {SPEAKER}" in capsys.readouterr().err.lower()


def test_the_speaker_over_http(sft, tts):
    config = ServerConfig(model=str(sft), device="cpu", max_running=2, max_context=512, warmup=False)
    with ServerThread(config, tts) as server:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert model["speakers"] == [SPEAKER] and model["task_type"] == "CustomVoice"
        voices = httpx.get(server.url + "/v1/audio/voices").json()["data"]
        assert [v["id"] for v in voices] == [SPEAKER]
        for voice in (SPEAKER, "alloy"):  # (OpenAI's names stand for the checkpoint's first speaker)
            response = httpx.post(server.url + "/v1/audio/speech", timeout=60, json={
                "input": "Hello.", "voice": voice, "response_format": "pcm", "max_new_tokens": 4, "seed": 1})
            assert response.status_code == 200 and len(response.content) == 2 * 3 * FRAME
        python = tts.synthesize("Hello.", speaker=SPEAKER, max_new_tokens=4, seed=1)
        assert len(python) == 3 * FRAME
