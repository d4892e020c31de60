"""The incremental codec decoder: any chunk schedule gives exactly the whole-sequence decode."""

from __future__ import annotations

import copy

import pytest
import torch

from q3tts.engine.runner.codec_stream import StreamingDecoder
from q3tts.models.speech_tokenizer import SpeechTokenizer
from q3tts.tiny.shapes import TinyShape
from q3tts.tiny.speech_tokenizer import write_tiny_speech_tokenizer

FRAMES = 330  # beyond 300, where the official chunked decode stops being exact
TOL = 1e-5


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    folder = write_tiny_speech_tokenizer(tmp_path_factory.mktemp("st"), seed=3)
    return SpeechTokenizer.from_pretrained(folder, load_encoder=False).decoder


@pytest.fixture(scope="module")
def codes():
    return torch.randint(0, 2048, (2, 16, FRAMES), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def whole(decoder, codes):
    with torch.no_grad():
        return decoder(codes)[:, 0]


def _stream(decoder, codes, schedule) -> torch.Tensor:
    stream = StreamingDecoder(decoder, max_rows=codes.shape[0])
    chunks, t, i = [], 0, 0
    while t < codes.shape[-1]:
        n = schedule[min(i, len(schedule) - 1)]
        chunks.append(stream.decode(codes[:, :, t:t + n]))
        t, i = t + n, i + 1
    return torch.cat(chunks, dim=-1)


@pytest.mark.parametrize("chunk", [1, 2, 3, 8, 25])
def test_fixed_chunks_equal_whole_decode(decoder, codes, whole, chunk):
    out = _stream(decoder, codes, [chunk])
    assert out.shape == whole.shape
    assert float((out - whole).abs().max()) <= TOL


def test_changing_schedule_equals_whole_decode(decoder, codes, whole):
    out = _stream(decoder, codes, [1, 1, 2, 3, 5, 8, 13, 25, 7, 1, 40])
    assert float((out - whole).abs().max()) <= TOL


def test_streams_at_different_positions_share_a_call(decoder, codes, whole):
    """Row 1 starts 37 frames after row 0; each call advances both by one frame."""
    stream = StreamingDecoder(decoder, max_rows=2)
    head = stream.decode_rows([0], codes[:1, :, :37])
    out0, out1 = [head], []
    for t in range(0, 60):
        wav = stream.decode(torch.stack([codes[0, :, 37 + t], codes[1, :, t]])[:, :, None])
        out0.append(wav[:1])
        out1.append(wav[1:])
    samples = stream.decoder.samples_per_frame
    assert float((torch.cat(out0, -1) - whole[:1, : 97 * samples]).abs().max()) <= TOL
    assert float((torch.cat(out1, -1) - whole[1:, : 60 * samples]).abs().max()) <= TOL


def test_priming_with_reference_codes(decoder, codes, whole):
    """A voice's reference codes prime the state once; the stream then yields only the new frames' audio,
    equal to the tail of decoding reference + new frames together."""
    stream = StreamingDecoder(decoder, max_rows=3)
    stream.reset([2])
    stream.decode_rows([2], codes[1:2, :, :50])  # the reference: decoded once, its audio discarded
    out = torch.cat([stream.decode_rows([2], codes[1:2, :, t:t + 4]) for t in range(50, 90, 4)], -1)
    samples = decoder.samples_per_frame
    assert float((out - whole[1:, 50 * samples: 90 * samples]).abs().max()) <= TOL
    stream.reset([2])
    assert all(float(t[2].abs().max()) == 0 for t in stream.state.tensors())


@pytest.mark.parametrize(("size", "seed"), [("1b7", 2), ("1b7", 8)])
def test_other_shapes_stream_as_accurately_as_the_whole_decode(tmp_path, size, seed):
    """Codecs of shapes drawn within the official family (widths, depths, windows; upsampling 2x2 with vocoder
    rates 8-10-6 and 4-4-5-3-2), their vocoders conditioned by the last convolution only, so that they
    amplify float32 rounding 5-50x more than the built-in codec: two rows, one primed with a 12-frame reference,
    then frame by frame. Their audio is no farther from the float64 decode than 2.5x the whole-sequence float32
    decode is, and within 3x that decode's error of it (docs/faithfulness.md: no two float32 orders of operations
    agree closer; 1e-5 above is the built-in codec's)."""
    folder = write_tiny_speech_tokenizer(tmp_path, seed=seed, shape=TinyShape.random(seed, size))
    decoder = SpeechTokenizer.from_pretrained(folder, load_encoder=False).decoder
    codes = torch.randint(0, 2048, (2, 16, 30), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        whole, exact = decoder(codes)[:, 0].double(), copy.deepcopy(decoder).double()(codes)[:, 0]
    stream = StreamingDecoder(decoder, max_rows=2)
    head = stream.decode_rows([0], codes[:1, :, :12])
    rows = [[head], []]
    for t in range(18):
        wav = stream.decode(torch.stack([codes[0, :, 12 + t], codes[1, :, t]])[:, :, None])
        rows[0].append(wav[:1])
        rows[1].append(wav[1:])
    n = decoder.samples_per_frame
    for row, end in ((0, 30), (1, 18)):
        out = torch.cat(rows[row], -1)[0].double()
        whole_error = float((whole[row, :end * n] - exact[row, :end * n]).abs().max())
        assert float((out - exact[row, :end * n]).abs().max()) <= max(TOL / 2, 2.5 * whole_error)
        assert float((out - whole[row, :end * n]).abs().max()) <= max(TOL, 3 * whole_error)


def test_state_size_is_bounded(decoder, codes):
    stream = StreamingDecoder(decoder, max_rows=1)
    before = stream.state_numel
    stream.decode(codes[:1, :, :40])
    assert stream.state_numel == before  # independent of the stream's length



def test_codes_outside_the_codebook_are_refused(decoder, codes):
    stream = StreamingDecoder(decoder, max_rows=1)
    bad = codes[:1, :, :3].clone()
    bad[0, 0, 1] = decoder.config.codebook_size  # would read codebook 1's first vector
    with pytest.raises(ValueError, match="codes must lie in"):
        stream.decode(bad)
    with pytest.raises(ValueError, match="codes must lie in"):
        stream.decode_rows([0], bad)
