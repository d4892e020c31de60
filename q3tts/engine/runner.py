"""The model runner: owns every device tensor of the fast decode path and runs one frame for all rows.

Rows 0..B-1 of the static state are the running sequences (the scheduler keeps them compact). One frame =
sample codebook 0 from each row's last talker hidden state, run the whole 15-step code predictor with its
sampling, and feed the frame back through the talker. On CUDA the frame is captured as one graph per batch
bucket at start-up (largest first, one memory pool); padding rows of a bucket are finished rows that write
only to the scratch KV block 0. Nothing in the frame reads back to the host: EOS and length limits set `done`
on the device, and the host collects codes through pinned buffers and events, one frame behind.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..generate import MIN_NEW_TOKENS, suppressed_ids
from ..models.qwen3_tts import Qwen3TTSModel
from ..prompt import Prompt
from ..sampling import SamplerTensors, SamplingParams
from ..transfer import to_device
from .decoder import FlatDecoder, PagedCache
from .sampler import TalkerProcessors, sample_tokens

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class EngineConfig:
    max_rows: int = 256
    max_context: int = 4096  # talker positions per row (prompt + frames)
    block_size: int = 64
    num_blocks: int | None = None  # None: enough for max_rows x max_context
    max_trailing: int = 4100  # trailing text ids per row
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    prefill_buckets: tuple[int, ...] = (32, 64, 128, 256, 512)  # prefill token counts captured as graphs
    use_graphs: bool = True

    def __post_init__(self):
        self.buckets = tuple(sorted(b for b in self.buckets if b <= self.max_rows))
        if not self.buckets or self.buckets[-1] != self.max_rows:
            self.buckets = (*self.buckets, self.max_rows)
        if self.max_context % self.block_size:
            raise ValueError("max_context must be a multiple of block_size")
        if any(b < 1 for b in self.prefill_buckets):
            raise ValueError(f"prefill_buckets must be positive token counts, got {self.prefill_buckets}")
        self.prefill_buckets = tuple(sorted(self.prefill_buckets))  # () captures none: every prefill runs eagerly


class RowState:
    """Static per-row tensors ([max_rows, ...]) read and written by the frame step."""

    def __init__(self, rows: int, hidden: int, vocab: int, max_trailing: int, dtype: torch.dtype,
                 device: torch.device):
        z = lambda *shape, dt=torch.int64: torch.zeros(*shape, dtype=dt, device=device)
        self.hidden = z(rows, hidden, dt=dtype)  # normed talker hidden that predicts the next frame
        self.positions = z(rows, dt=torch.int32)  # next talker position
        self.steps = z(rows)  # codebook-0 tokens sampled so far
        self.max_new = z(rows)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.emitted = z(rows, dt=torch.bool)  # the last frame step produced a frame for this row
        self.codes = z(rows, 16)  # the last frame step's codes
        self.seen = z(rows, vocab, dt=torch.bool)
        self.penalty = torch.ones(rows, device=device)
        self.seeds = z(rows)
        self.trailing_ids = z(rows, max_trailing, dt=torch.int32)
        self.trailing_len = z(rows)
        self.talker_sampler = SamplerTensors.empty(rows, device)
        self.cp_sampler = SamplerTensors.empty(rows, device)


class ModelRunner:
    def __init__(self, model: Qwen3TTSModel, config: EngineConfig | None = None):
        self.model, self.config = model, config or EngineConfig()
        cfg = self.config
        talker = model.talker
        tc, cc = talker.config, talker.code_predictor.config
        self.device = talker.codec_head.weight.device
        self.dtype = talker.codec_head.weight.dtype
        self.talker = FlatDecoder(talker.model.layers, talker.model.norm.weight, tc.rms_norm_eps,
                                  tc.num_attention_heads, tc.head_dim, talker.model.inv_freq)
        cp = talker.code_predictor
        self.cp = FlatDecoder(cp.model.layers, cp.model.norm.weight, cc.rms_norm_eps, cc.num_attention_heads,
                              cc.head_dim, cp.model.inv_freq)
        blocks_per_row = cfg.max_context // cfg.block_size
        num_blocks = cfg.num_blocks or cfg.max_rows * blocks_per_row + 1
        # Row max_rows is a scratch row (all blocks -> block 0) for the padding tokens of a bucketed prefill.
        self.cache = PagedCache.allocate(tc.num_hidden_layers, num_blocks, cfg.block_size, tc.num_key_value_heads,
                                         tc.head_dim, cfg.max_rows + 1, blocks_per_row, self.dtype, self.device)
        # The code predictor's 16 positions per frame: one block per row, block r for row r.
        self.cp_cache = PagedCache.allocate(cc.num_hidden_layers, cfg.max_rows, cc.num_code_groups,
                                            cc.num_key_value_heads, cc.head_dim, cfg.max_rows, 1, self.dtype,
                                            self.device)
        self.cp_cache.block_table.copy_(torch.arange(cfg.max_rows, device=self.device, dtype=torch.int32)[:, None])
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # block 0: scratch for finished/padding rows
        self.row_blocks: list[list[int]] = [[] for _ in range(cfg.max_rows)]
        self.state = RowState(cfg.max_rows, tc.hidden_size, tc.vocab_size, cfg.max_trailing, self.dtype,
                              self.device)
        self.suppress = suppressed_ids(talker)
        self.row_ids = torch.arange(cfg.max_rows, device=self.device, dtype=torch.int32)
        self.cp_first = (torch.arange(2 * cfg.max_rows, device=self.device, dtype=torch.int32) // 2,
                         torch.arange(2 * cfg.max_rows, device=self.device, dtype=torch.int32) % 2)
        self.cp_positions = torch.arange(cc.num_code_groups, device=self.device, dtype=torch.int32)[:, None].expand(
            -1, cfg.max_rows).contiguous()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        n = max(cfg.prefill_buckets, default=0)
        self.prefill_x = torch.zeros(n, tc.hidden_size, dtype=self.dtype, device=self.device)
        self.prefill_rows = torch.full((n,), cfg.max_rows, dtype=torch.int32, device=self.device)
        self.prefill_positions = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.prefill_out = torch.zeros(n, tc.hidden_size, dtype=self.dtype, device=self.device)
        self._head_out_dtype = _probe_fp32_head(self.device, self.dtype)

    # ---- admission --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def add_rows(self, rows: list[int], prompts: list[Prompt], params: list[SamplingParams]) -> None:
        """Prefills `prompts` into `rows` and arms them. Blocks for prompt + max_new_tokens are reserved."""
        s, dev = self.state, self.device
        lengths = [p.embeds.shape[0] for p in prompts]
        for n, p, prm in zip(lengths, prompts, params):  # check everything before reserving anything
            if len(p.trailing_ids) > self.config.max_trailing:
                raise ValueError(f"text too long for this engine ({len(p.trailing_ids)} trailing tokens)")
            if n + prm.max_new_tokens > self.config.max_context:
                raise ValueError(f"{n + prm.max_new_tokens} positions exceed the engine's max_context "
                                 f"{self.config.max_context}")
        for row, n, prm in zip(rows, lengths, params):
            self._reserve(row, n + prm.max_new_tokens)
        idx = to_device(rows, dev)
        hidden = self._prefill_tokens(rows, lengths, to_device(torch.cat([p.embeds for p in prompts]), dev))
        last = to_device(torch.tensor(lengths).cumsum(0) - 1, dev)
        s.hidden[idx] = hidden[last]
        s.positions[idx] = to_device(lengths, dev, torch.int32)
        s.steps[idx] = 0
        s.done[idx] = False
        s.emitted[idx] = False
        s.seen[idx] = False
        s.max_new[idx] = to_device([p.max_new_tokens for p in params], dev, s.max_new.dtype)
        s.penalty[idx] = to_device([p.repetition_penalty for p in params], dev, torch.float32)
        s.seeds[idx] = to_device([p.seed for p in params], dev, s.seeds.dtype)
        s.talker_sampler.assign(idx, SamplerTensors.build(params, False, dev))
        s.cp_sampler.assign(idx, SamplerTensors.build(params, True, dev))
        s.trailing_len[idx] = to_device([len(p.trailing_ids) for p in prompts], dev, s.trailing_len.dtype)
        for row, p in zip(rows, prompts):
            if p.trailing_ids:
                s.trailing_ids[row, : len(p.trailing_ids)] = to_device(p.trailing_ids, dev, torch.int32)

    def _prefill_tokens(self, rows: list[int], lengths: list[int], x: torch.Tensor) -> torch.Tensor:
        """Runs the prompts' tokens (rows[i] gets lengths[i] tokens at positions 0..) through the talker and
        returns their normed hidden states [N, H]. Up to the largest prefill bucket the tokens are padded to a
        bucket (padding tokens go to the scratch row) and the captured graph runs; beyond it, eagerly."""
        N, dev = x.shape[0], self.device
        flat_rows = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int32), torch.tensor(lengths))
        flat_pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
        bucket = next((b for b in self.config.prefill_buckets if b >= N), None)
        if bucket is None:
            return self.talker(x, to_device(flat_rows, dev), to_device(flat_pos, dev), self.cache)
        pad = bucket - N
        self.prefill_x[:N].copy_(x)
        padded_rows = torch.cat([flat_rows, torch.full((pad,), self.config.max_rows, dtype=torch.int32)])
        padded_positions = torch.cat([flat_pos, torch.zeros(pad, dtype=torch.int32)])
        self.prefill_rows[:bucket].copy_(to_device(padded_rows, dev))
        self.prefill_positions[:bucket].copy_(to_device(padded_positions, dev))
        replay_or_run(self.prefill_graphs, self._prefill, bucket)
        return self.prefill_out[:N]

    def _prefill(self, bucket: int) -> None:
        self.prefill_out[:bucket] = self.talker(self.prefill_x[:bucket], self.prefill_rows[:bucket],
                                                self.prefill_positions[:bucket], self.cache)

    def release_rows(self, rows: list[int]) -> None:
        """Frees the rows' KV blocks; the rows become padding (finished, scratch block)."""
        for row in rows:
            self.free_blocks.extend(self.row_blocks[row])
            self.row_blocks[row] = []
        idx = to_device(rows, self.device)
        self.cache.block_table[idx] = 0
        self.state.done[idx] = True
        self.state.positions[idx] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Moves the sequence in row `src` to the free row `dst` (between frames, device copies only), so the
        running rows stay 0..B-1; `src` becomes a padding row."""
        s = self.state
        for value in vars(s).values():
            tensors = [getattr(value, f) for f in ("do_sample", "temperature", "top_k", "top_p")] \
                if isinstance(value, SamplerTensors) else [value]
            for t in tensors:
                t[dst] = t[src]
        self.cache.block_table[dst] = self.cache.block_table[src]
        self.row_blocks[dst], self.row_blocks[src] = self.row_blocks[src], []
        self.cache.block_table[src] = 0
        s.done[src] = True
        s.positions[src] = 0

    def _reserve(self, row: int, num_positions: int) -> None:
        bs = self.config.block_size
        need = -(-num_positions // bs) - len(self.row_blocks[row])
        if need > len(self.free_blocks):
            raise MemoryError("KV cache is full")
        new = [self.free_blocks.pop() for _ in range(max(need, 0))]
        start = len(self.row_blocks[row])
        self.row_blocks[row] += new
        if new:
            self.cache.block_table[row, start:start + len(new)] = to_device(new, self.device, torch.int32)

    # ---- the frame -------------------------------------------------------------------------------------------

    def bucket(self, num_rows: int) -> int:
        return next(b for b in self.config.buckets if b >= num_rows)

    @torch.no_grad()
    def step(self, num_rows: int) -> None:
        """One frame for rows 0..num_rows-1 (the padding rows of the bucket run too, harmlessly)."""
        replay_or_run(self.graphs, self._frame, self.bucket(num_rows))

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """Captures every bucket, largest first, into one memory pool. Call before admitting any row."""
        if self.device.type != "cuda" or not self.config.use_graphs:
            return
        self.graphs = capture_buckets(self._frame, self.config.buckets)
        self.prefill_graphs = capture_buckets(self._prefill, self.config.prefill_buckets)
        self._reset_state()

    def _reset_state(self) -> None:
        cfg, tc = self.config, self.model.talker.config
        self.state = _copy_into(self.state, RowState(cfg.max_rows, tc.hidden_size, tc.vocab_size, cfg.max_trailing,
                                                     self.dtype, self.device))

    def _head(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._head_out_dtype:
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return F.linear(hidden, weight).float()

    def _frame(self, B: int) -> None:
        c0, c0_embed = self._sample_codebook0(B)
        codes, frame = self._predict_residual_codes(B, c0, c0_embed)
        self._talker_step(B, c0, codes, frame)

    def _sample_codebook0(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, talker = self.state, self.model.talker
        tc = talker.config
        procs = TalkerProcessors(s.seen[:B], s.penalty[:B], s.steps[:B], self.suppress, tc.codec_eos_token_id,
                                 MIN_NEW_TOKENS)
        c0 = sample_tokens(self._head(s.hidden[:B], talker.codec_head.weight), s.talker_sampler.prefix(B),
                           s.seeds[:B], s.steps[:B] * 16, procs)
        return c0, talker.model.codec_embedding(c0)

    def _predict_residual_codes(self, B: int, c0: torch.Tensor,
                                c0_embed: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The 15 code-predictor steps with their sampling; returns the 16 codes and the frame embedding
        F(c) = Ec(c0) + sum_j Ecp[j](c_j+1) (fp32), which the talker consumes next."""
        s, cp = self.state, self.model.talker.code_predictor
        seeds, counters, sampler = s.seeds[:B], s.steps[:B] * 16, s.cp_sampler.prefix(B)
        frame = c0_embed.float()
        # Positions 0 and 1 (talker hidden, Ec(c0)) in one pass, then one position per code.
        x = torch.stack([s.hidden[:B], c0_embed], dim=1).view(2 * B, -1)
        h = self.cp(cp.small_to_mtp_projection(x), self.cp_first[0][: 2 * B], self.cp_first[1][: 2 * B],
                    self.cp_cache)[1::2]
        codes = [c0]
        for g in range(cp.config.num_code_groups - 1):
            code = sample_tokens(self._head(h, cp.lm_head[g].weight), sampler, seeds, counters + g + 1)
            codes.append(code)
            embed = cp.model.codec_embedding[g](code)
            frame = frame + embed.float()
            if g < cp.config.num_code_groups - 2:
                h = self.cp(cp.small_to_mtp_projection(embed), self.row_ids[:B], self.cp_positions[g + 2, :B],
                            self.cp_cache)
        return codes, frame

    def _talker_step(self, B: int, c0: torch.Tensor, codes: list[torch.Tensor], frame: torch.Tensor) -> None:
        """Feeds the frame plus this step's trailing text (TTS_PAD once used up) and updates the row state."""
        s, talker = self.state, self.model.talker
        steps = s.steps[:B]
        in_text = steps < s.trailing_len[:B]
        text_id = s.trailing_ids[:B].gather(1, steps.clamp(max=s.trailing_ids.shape[1] - 1)[:, None])[:, 0]
        text_id = torch.where(in_text, text_id, self.model.config.tts_pad_token_id)
        x = frame + talker.embed_text(text_id).float()
        new_hidden = self.talker(x, self.row_ids[:B], s.positions[:B], self.cache)
        finished = (c0 == talker.config.codec_eos_token_id) | (steps + 1 >= s.max_new[:B])
        s.emitted[:B] = ~s.done[:B] & ~finished
        s.done[:B] |= finished
        # A finished row's frame is never emitted; its EOS id (beyond the codebook) must not reach the codec.
        codes[0] = torch.where(finished, 0, c0)
        s.codes[:B] = torch.stack(codes, dim=1)
        s.hidden[:B] = new_hidden
        s.positions[:B] += (~s.done[:B]).int()
        s.steps[:B] += 1


    @torch.no_grad()
    def teacher_forced_logits(self, prompt: Prompt, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fast path's raw logits for a fixed history (same kernels and weights as the frame step, run as
        one pass): talker [T + 1, V] and code predictor [T, 15, 2048], as q3tts.teacher_forcing returns them.
        Uses row 0 of the talker cache and the code predictor's rows: call with no rows admitted."""
        talker, cp = self.model.talker, self.model.talker.code_predictor
        codes = codes.to(self.device)
        T, L = codes.shape[0], prompt.embeds.shape[0]
        embeds = [talker.model.codec_embedding(codes[:, 0])]
        embeds += [cp.model.codec_embedding[g](codes[:, g + 1]) for g in range(cp.config.num_code_groups - 1)]
        frame = torch.stack([e.float() for e in embeds]).cumsum(0)[-1]  # sequential fp32 sum, as the frame step
        trailing = torch.tensor(prompt.trailing_ids + [self.model.config.tts_pad_token_id] * T, device=self.device)
        x = torch.cat([prompt.embeds.to(self.device).float(), frame + talker.embed_text(trailing[:T]).float()])
        if L + T > self.config.max_context:
            raise ValueError(f"{L + T} positions exceed the engine's max_context {self.config.max_context}")
        self._reserve(0, L + T)
        positions = torch.arange(L + T, device=self.device, dtype=torch.int32)
        hidden = self.talker(x, torch.zeros_like(positions), positions, self.cache)[L - 1:]
        self.release_rows([0])
        talker_logits = self._head(hidden, talker.codec_head.weight)
        inputs = torch.stack([hidden[:T]] + embeds[:-1], dim=1)  # [T, 16, H]
        cp_logits = []
        for chunk in inputs.split(self.config.max_rows):  # one code-predictor cache row per frame
            n = chunk.shape[0]
            rows = torch.arange(n, device=self.device, dtype=torch.int32).repeat_interleave(16)
            h = self.cp(cp.small_to_mtp_projection(chunk.reshape(n * 16, -1)), rows, positions[:16].repeat(n),
                        self.cp_cache).view(n, 16, -1)
            cp_logits.append(torch.stack([self._head(h[:, g + 1], cp.lm_head[g].weight) for g in range(15)], dim=1))
        return talker_logits, torch.cat(cp_logits)


def capture_buckets(run, buckets: tuple[int, ...], stream: torch.cuda.Stream | None = None
                    ) -> dict[int, torch.cuda.CUDAGraph]:
    """One CUDA graph of `run(B)` per bucket, largest first, all in one memory pool (nano-vllm's order: the
    largest bucket's allocations are reused by the smaller ones). Each is run once eagerly first, which
    compiles the Triton kernels and lets cuBLAS and cuDNN pick their algorithms outside the capture.

    Graphs that will replay concurrently with others must be captured on a `stream` of their own: cuBLAS keeps
    one workspace per (handle, stream), and a graph captures the capture stream's, so two graphs captured on
    the same stream share a workspace and race on it when they run at the same time."""
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for B in sorted(buckets, reverse=True):
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            run(B)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            run(B)
        graphs[B] = graph
    torch.cuda.synchronize()
    return graphs


def replay_or_run(graphs: dict[int, torch.cuda.CUDAGraph], run, bucket: int) -> None:
    """Replays the bucket's captured graph of `run`, or runs it eagerly where none was captured."""
    graph = graphs.get(bucket)
    if graph is not None:
        graph.replay()
    else:
        run(bucket)


def _copy_into(old: RowState, new: RowState) -> RowState:
    """Resets `old` in place to `new`'s values (graphs keep pointing at `old`'s tensors)."""
    for name, value in vars(new).items():
        target = getattr(old, name)
        if isinstance(value, SamplerTensors):
            for field in ("do_sample", "temperature", "top_k", "top_p"):
                getattr(target, field).copy_(getattr(value, field))
        else:
            target.copy_(value)
    return old


def _probe_fp32_head(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build can produce fp32 logits straight from bf16/fp16 matrix products (cuBLAS)."""
    if device.type != "cuda" or dtype == torch.float32:
        return False
    try:
        a = torch.ones(2, 8, dtype=dtype, device=device)
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False
