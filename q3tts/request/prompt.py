"""Builds the talker's prefill embeddings and the per-step trailing text for one request (spec section 4.1)."""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..engine.prompt import Prompt
from ..engine.runner.prefix_cache import PrefixCache, tensor_digest, tensor_digests
from ..models.talker import Talker
from ..transfer import to_device


@dataclass
class PromptSpec:
    """Everything that shapes one request's prompt, already tokenized and validated."""

    input_ids: list[int]  # "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
    language: str  # lower case; "auto" means no language tag
    non_streaming_mode: bool
    instruct_ids: list[int] | None = None  # "<|im_start|>user\n{instruct}<|im_end|>\n"
    speaker: str | None = None  # a CustomVoice preset speaker
    speaker_embedding: torch.Tensor | None = None  # [H] x-vector (Base)
    ref_ids: list[int] | None = None  # "<|im_start|>assistant\n{ref_text}<|im_end|>\n" (ICL)
    ref_codes: torch.Tensor | None = None  # [T_ref, 16] (ICL)


def language_id(config: ModelConfig, language: str, speaker: str | None) -> int | None:
    """The codec language tag, with the official dialect rule for CustomVoice speakers."""
    tc = config.talker_config
    lid = None if language == "auto" else tc.codec_language_id[language]
    dialect = tc.spk_is_dialect.get(speaker) if speaker else None
    if language in ("chinese", "auto") and dialect:
        lid = tc.codec_language_id[dialect]
    return lid


def prompt_length(config: ModelConfig, spec: PromptSpec) -> int:
    """The number of talker positions `build_prompt` gives `spec`, without building it."""
    n = len(spec.instruct_ids or ()) + 3  # instruction, assistant header
    n += (3 if language_id(config, spec.language, spec.speaker) is None else 4) + 1  # control tags, codec_pad
    n += (spec.speaker is not None) + (spec.speaker_embedding is not None)
    text = len(spec.input_ids) - 8
    if spec.ref_codes is not None:
        t1, t2 = len(spec.ref_ids) - 5 + text + 1, 1 + spec.ref_codes.shape[0]
        return n + (t1 + t2 if spec.non_streaming_mode else t2)
    return n + (text + 2 if spec.non_streaming_mode else 1)


@torch.no_grad()
def build_prompt(talker: Talker, config: ModelConfig, spec: PromptSpec, text_rows: torch.Tensor | None = None,
                 weights: tuple | None = None, first: torch.Tensor | None = None,
                 voice: tuple[bytes, torch.Tensor] | None = None) -> Prompt:
    """`text_rows`: the text projection of `_projected_ids(spec)` if already computed (`build_prompts`);
    `weights`: `_weights(talker)` if already known; `first`: in streaming mode without a reference, the first
    text position (text_rows[:1] + codec_bos) if already computed; `voice`: the voice's digest and head
    (`_voice_heads`) if already known."""
    tc = config.talker_config
    device = talker.codec_head.weight.device
    ids = lambda values: to_device(values, device, torch.long)  # no device sync per request
    tp, ec = talker.embed_text, talker.embed_codec
    weights = weights or _weights(talker)
    bos, eos, pad = _fixed(talker, weights, "text", (config.tts_bos_token_id, config.tts_eos_token_id,
                                                     config.tts_pad_token_id))

    voice, head = voice or _voice_heads(talker, config, [spec], weights)[0]
    parts = [head]
    text = spec.input_ids[3:-5]
    if spec.ref_codes is not None:
        if text_rows is None:
            text_rows = tp(ids(_projected_ids(spec)))
        icl, trailing, tail = _icl_part(talker, tc, text_rows, _reference_frames(talker, spec.ref_codes, weights),
                                        eos, pad, spec.non_streaming_mode)
        parts.append(icl)
        trailing_parts = (trailing,)
        # Streaming ICL trails whatever text did not fit beside the reference frames.
        icl_text = spec.ref_ids[3:-2] + text + [config.tts_eos_token_id]
        trailing_ids = icl_text[tail:] if tail is not None else []
    elif spec.non_streaming_mode:
        projected = tp(ids(text)) if text_rows is None else text_rows
        parts.append(torch.cat([projected, eos[None]]) + ec(ids([tc.codec_pad_id] * (len(text) + 1))))
        parts.append(pad[None] + ec(ids([tc.codec_bos_id])))
        trailing_parts, trailing_ids = (pad[None],), []
    else:  # (the official code projects the first text token and the rest in two calls)
        if first is None:
            codec_bos = _fixed(talker, weights, "codec", (tc.codec_bos_id,))  # the codec prefix's last row
            first = (tp(ids(text[:1])) if text_rows is None else text_rows[:1]) + codec_bos
        parts.append(first)
        trailing_parts = (tp(ids(text[1:])) if text_rows is None else text_rows[1:], eos[None])
        trailing_ids = text[1:] + [config.tts_eos_token_id]
    prompt = Prompt(parts=tuple(parts), trailing_parts=trailing_parts, pad=pad, trailing_ids=trailing_ids)
    prompt.prefix_len, prompt.prefix_key = prefix_of(spec, voice, head.shape[0], prompt.num_positions)
    return prompt


@torch.no_grad()
def build_prompts(talker: Talker, config: ModelConfig, specs: list[PromptSpec]) -> list[Prompt]:
    """`build_prompt` for many requests at once (a burst). In half precision the text of all of them is projected
    in one call instead of one or two per request, and the first text positions of the streaming ones get their
    codec_bos in one addition, which takes most of the small launches out of a prompt; the projected rows then
    differ from per-request calls in the last bits, as any two batch sizes of the same matrix product may. In
    fp32 every prompt is built exactly as `build_prompt` alone builds it (the official implementation's
    per-request calls, bit for bit)."""
    weights = _weights(talker)
    voices = _voice_heads(talker, config, specs, weights)
    if len(specs) < 2 or talker.codec_head.weight.dtype == torch.float32:
        return [build_prompt(talker, config, spec, weights=weights, voice=voice)
                for spec, voice in zip(specs, voices)]
    device = talker.codec_head.weight.device
    lists = [_projected_ids(spec) for spec in specs]
    flat = [i for ids in lists for i in ids]
    rows = talker.embed_text(to_device(flat, device, torch.long))
    ends = torch.tensor([len(ids) for ids in lists]).cumsum(0).tolist()
    streaming = [i for i, spec in enumerate(specs)
                 if spec.ref_codes is None and not spec.non_streaming_mode and lists[i]]  # (no text: build_prompt's)
    firsts = {}
    if streaming:
        codec_bos = _fixed(talker, weights, "codec", (config.talker_config.codec_bos_id,))
        at = to_device([ends[i] - len(lists[i]) for i in streaming], device, torch.long)
        firsts = dict(zip(streaming, (rows[at] + codec_bos).split(1)))
    return [build_prompt(talker, config, spec, rows[end - len(ids):end], weights, firsts.get(i), voices[i])
            for i, (spec, ids, end) in enumerate(zip(specs, lists, ends))]


def _projected_ids(spec: PromptSpec) -> list[int]:
    """The text ids whose projection a prompt uses, in order: an in-context voice's transcript then the text."""
    text = spec.input_ids[3:-5]
    return spec.ref_ids[3:-2] + text if spec.ref_codes is not None else text


def _voice_heads(talker: Talker, config: ModelConfig, specs: list[PromptSpec],
                 weights: tuple) -> list[tuple[bytes, torch.Tensor]]:
    """Each prompt's positions before the text (instruction, assistant header, the codec prefix but its last row)
    and their inputs' digest. They depend on the voice alone: computed once per voice and kept per talker, the
    most recently used within HEAD_CACHE_BYTES. The voices not kept yet are computed together (a burst of new
    voices): their codec rows in one embedding lookup, their speaker embeddings digested together and written in
    one copy, every head gathered from them in one copy and kept after one synchronization, instead of a dozen
    small launches, three copies and a synchronization per voice. Lookups, additions and copies give the same bits
    in any batch."""
    embedded = iter(tensor_digests([spec.speaker_embedding for spec in specs if spec.speaker_embedding is not None]))
    keys = [voice_digest(config, spec, None if spec.speaker_embedding is None else next(embedded)) for spec in specs]
    with _HEADS_LOCK:
        cache = _HEADS.setdefault(talker, _HeadCache())
        heads = {key: cache.get(key, weights) for key in dict.fromkeys(keys)}
    new = {key: spec for key, spec in zip(keys, specs) if heads[key] is None}  # one request per new voice
    if new:
        heads.update(zip(new, _compute_heads(talker, config, list(new.values()), weights)))
        _keep(talker, {key: heads[key] for key in new}, weights)
    return [(key, heads[key]) for key in keys]


def _compute_heads(talker: Talker, config: ModelConfig, specs: list[PromptSpec], weights: tuple) -> list[torch.Tensor]:
    """The heads of `specs` (one per voice), as `_voice_heads` describes them (spec section 4.1: the codec
    prefix without codec_bos, TTS_PAD over all but its last row and TTS_BOS over that)."""
    tc, device = config.talker_config, talker.codec_head.weight.device
    specials = _fixed(talker, weights, "text", (config.tts_bos_token_id, config.tts_eos_token_id,
                                                config.tts_pad_token_id))
    codec_ids, over, spoken, embeddings, sizes = [], [], [], [], []
    for spec in specs:
        ids = _control_ids(config, spec) + ([tc.spk_id[spec.speaker]] if spec.speaker else [])
        if spec.speaker_embedding is not None:  # its row: the embedding itself, written over this one below
            spoken.append(len(codec_ids) + len(ids))
            embeddings.append(spec.speaker_embedding.reshape(-1))  # (any shape of `hidden` values: request.py)
            ids.append(tc.codec_pad_id)
        ids.append(tc.codec_pad_id)
        codec_ids += ids
        over += [2] * (len(ids) - 1) + [0]  # rows of `specials`: TTS_PAD, then TTS_BOS
        sizes.append(len(ids))
    n = len(codec_ids)
    index = to_device(codec_ids + over + spoken, device, torch.long)
    codec = talker.embed_codec(index[:n])
    if embeddings:
        on_host = all(e.device.type == "cpu" for e in embeddings)  # (one copy for all of them)
        rows = torch.stack(embeddings if on_host else [e.to(device) for e in embeddings]).to(specials.dtype)
        codec.index_copy_(0, index[2 * n:], to_device(rows, device))
    codec = specials[index[n:2 * n]] + codec
    # Each head: its instruction's projection (each projected alone: a projection's bits depend on its batch), the
    # assistant header, its codec block; all of them gathered from one source in one copy, as views of one tensor
    # (the cache counts their storage once: PrefixCache).
    sources, gather, lengths, offset = [codec], [], [], n
    instructions = [spec.instruct_ids for spec in specs if spec.instruct_ids]
    if instructions:
        flat = to_device([i for ids in instructions for i in ids], device, torch.long)
        sources += [talker.embed_text(part) for part in flat.split([len(ids) for ids in instructions])]
    headers: dict[tuple[int, ...], int] = {}  # <|im_start|>assistant\n: where in the sources
    for spec in specs:
        header = tuple(spec.input_ids[:3])
        if header not in headers:
            headers[header] = sum(source.shape[0] for source in sources)
            sources.append(_fixed(talker, weights, "text", header))
    block = 0
    for spec, size in zip(specs, sizes):
        instruction = len(spec.instruct_ids or ())
        header, start = len(spec.input_ids[:3]), headers[tuple(spec.input_ids[:3])]
        gather += [*range(offset, offset + instruction), *range(start, start + header), *range(block, block + size)]
        lengths.append(instruction + header + size)
        offset, block = offset + instruction, block + size
    return list(torch.cat(sources)[to_device(gather, device, torch.long)].split(lengths))


def _keep(talker: Talker, parts: dict[bytes, torch.Tensor], weights: tuple) -> None:
    """Keeps a batch's new voice parts per talker once the device has computed them (a prompt built later on
    another stream or thread may read them): one synchronization for all of them."""
    device = next(iter(parts.values())).device
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    with _HEADS_LOCK:
        cache = _HEADS.setdefault(talker, _HeadCache())
        for key, value in parts.items():
            cache.put(key, value, weights)


HEAD_CACHE_BYTES = 64 * 2**20


class _HeadCache:
    """The engine's least-recently-used cache by bytes (PrefixCache), emptied when the embeddings it was computed
    from (`weights`) change."""

    def __init__(self):
        self.kept, self.weights = PrefixCache(HEAD_CACHE_BYTES), None

    def get(self, key: bytes, weights: tuple) -> torch.Tensor | None:
        if weights != self.weights:  # the model's embeddings changed: nothing kept is valid
            self.kept, self.weights = PrefixCache(HEAD_CACHE_BYTES), weights
        hit = self.kept.get(key)
        return hit[0] if hit is not None else None

    def put(self, key: bytes, head: torch.Tensor, weights: tuple) -> None:
        if weights == self.weights:
            self.kept.put(key, head)


_HEADS: weakref.WeakKeyDictionary[Talker, _HeadCache] = weakref.WeakKeyDictionary()
_HEADS_LOCK = threading.Lock()


def forget_kept_heads() -> None:
    """Drops every talker's kept voice heads, so that the next prompt is built with nothing kept (for tests)."""
    with _HEADS_LOCK:
        _HEADS.clear()


def kept_heads(talker: Talker) -> PrefixCache:
    """The voice heads (and in-context reference frames) kept for `talker` (for tests)."""
    with _HEADS_LOCK:
        return _HEADS[talker].kept


def _weights(talker: Talker) -> tuple:
    """What the cached embeddings were computed from (they are stale once any of it changes)."""
    params = [talker.model.text_embedding.weight, talker.model.codec_embedding.weight,
              *talker.text_projection.parameters()]
    return tuple((p.data_ptr(), p._version) for p in params)


def _control_ids(config: ModelConfig, spec: PromptSpec) -> list[int]:
    """The codec prefix's control tags: think or nothink, and the language tag if any."""
    tc, lid = config.talker_config, language_id(config, spec.language, spec.speaker)
    return ([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id] if lid is None
            else [tc.codec_think_id, tc.codec_think_bos_id, lid, tc.codec_think_eos_id])


def voice_digest(config: ModelConfig, spec: PromptSpec, embedding: bytes | None) -> bytes:
    """A digest of everything the positions before the text depend on (`embedding`: the speaker embedding's
    `tensor_digest`, if the spec has one)."""
    digest = hashlib.blake2b(repr((spec.instruct_ids, spec.input_ids[:3], _control_ids(config, spec),
                                   spec.speaker)).encode(), digest_size=16)
    if embedding is not None:
        digest.update(embedding)
    return digest.digest()


def prefix_of(spec: PromptSpec, voice: bytes, head_len: int, num_positions: int) -> tuple[int, str]:
    """How many of the prompt's first positions depend on the voice alone, and a digest of what they depend on
    (the engine's prefix cache reuses their keys and values). From the layout above: the instruction, the
    assistant header and the codec prefix but its last row (`head_len` positions, held back for the first text
    position; their inputs' digest `voice`) depend on the instruction, the language tag and the speaker; an
    in-context voice adds its transcript's positions (in streaming mode each also carries a reference frame; in
    non-streaming mode a codec pad). The text starts after them in every mode. At least the last position is
    always left to prefill."""
    n = head_len
    digest = hashlib.blake2b(voice, digest_size=16)
    if spec.ref_codes is not None:
        ref_text = len(spec.ref_ids) - 5
        n += ref_text if spec.non_streaming_mode else min(ref_text, 1 + spec.ref_codes.shape[0])
        digest.update(repr((spec.non_streaming_mode, spec.ref_ids[3:-2])).encode())
        digest.update(tensor_digest(spec.ref_codes))
    n = min(n, num_positions - 1)
    digest.update(str(n).encode())
    return n, digest.hexdigest()


_FIXED: weakref.WeakKeyDictionary[Talker, dict] = weakref.WeakKeyDictionary()


def _reference_frames(talker: Talker, ref_codes: torch.Tensor, weights: tuple) -> torch.Tensor:
    """codec_bos + the reference frames' embeddings [1 + T_ref, H] of an in-context voice: they depend on the
    voice alone, so they are kept with the voice heads (same budget, same invalidation), keyed by the codes'
    digest."""
    key = b"frames" + tensor_digest(ref_codes)
    with _HEADS_LOCK:
        heads = _HEADS.setdefault(talker, _HeadCache())
        hit = heads.get(key, weights)
    if hit is not None:
        return hit
    device = talker.codec_head.weight.device
    bos = talker.embed_codec(to_device([talker.config.codec_bos_id], device, torch.long))
    frames = torch.cat([bos, talker.embed_frame(to_device(ref_codes, device, torch.long))])
    _keep(talker, {key: frames}, weights)
    return frames


def _fixed(talker: Talker, weights: tuple, kind: str, ids: tuple[int, ...]) -> torch.Tensor:
    """tp(ids) (`kind` "text") or Ec(ids) ("codec") for the ids every prompt has (the special tokens, the
    assistant header, codec_bos), computed by the same call as before and kept per talker until its embeddings
    (`weights`: `_weights(talker)`) change."""
    cache = _FIXED.setdefault(talker, {})
    hit = cache.get((kind, ids))
    if hit is None or hit[0] != weights:
        device = talker.codec_head.weight.device
        embed = talker.embed_text if kind == "text" else talker.embed_codec
        embedded = embed(to_device(list(ids), device, torch.long))
        if device.type == "cuda":  # complete before a prompt built on another stream reads it
            torch.cuda.current_stream(device).synchronize()
        hit = cache[(kind, ids)] = (weights, embedded)
    return hit[1]


def _icl_part(talker: Talker, tc, projected: torch.Tensor, codec_embed: torch.Tensor, eos: torch.Tensor,
              pad: torch.Tensor, non_streaming: bool) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """Voice-clone ICL block: reference + target text (`projected`: their text projection) against codec_bos +
    reference frames (`codec_embed`). Returns the block, the trailing embeddings and where the trailing text
    starts in the ICL text (None: TTS_PAD only)."""
    text_embed = torch.cat([projected, eos[None]])  # [T1, H]
    t1, t2 = text_embed.shape[0], codec_embed.shape[0]
    if non_streaming:
        codec_pad = talker.embed_codec(torch.full((t1,), tc.codec_pad_id, device=codec_embed.device))
        return torch.cat([text_embed + codec_pad, codec_embed + pad]), pad[None], None
    if t1 > t2:
        return text_embed[:t2] + codec_embed, text_embed[t2:], t2
    return torch.cat([text_embed, pad.expand(t2 - t1, -1)]) + codec_embed, pad[None], None
