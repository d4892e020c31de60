"""One frame for every row (`FrameStep`, a part of `ModelRunner`), in four phases, each public for the benchmarks'
per-phase timings: the frame's inputs (`frame_inputs`), codebook 0 sampled from each row's talker hidden state
(`sample_codebook0`), the 15-step code predictor with its sampling (`predict_residual_codes`), and the frame fed
back through the talker (`talker_step`). Nothing here reads back to the host: EOS and length limits set `done` on
the device. `teacher_forced_logits` computes a fixed history's logits the same way, for the faithfulness tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.linear import fused_linear
from ...kernels.sampler import TalkerProcessors, sample_tokens
from ...sampling import MIN_NEW_TOKENS
from ..prompt import Prompt


class FrameStep:
    """The frame; mixed into `ModelRunner` (its decoders `talker` and `cp`, caches, `state`, the code predictor's
    tables, `decode_modes` and `fp32_head`)."""

    def head_logits(self, hidden: torch.Tensor, weight: torch.Tensor,
                    norm: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """fp32 logits of `hidden` (normed) through `weight`; with `norm` (weight, sums of squares or None), `hidden`
        is the code predictor's residual stream before its final norm, which the product applies
        (`_code_predictor`)."""
        if norm is not None:
            return fused_linear(hidden, weight, norm=norm[0], squares=norm[1], eps=self.cp.eps, fp32_out=True,
                                        pdl=hidden.shape[0] == 1)
        if self.fp32_head:
            if self.talker.fuses(hidden.shape[0], self.decode_modes["fused"]):
                return fused_linear(hidden, weight, fp32_out=True)
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return F.linear(hidden, weight).float()

    def frame(self, B: int) -> None:
        """One frame of the first B rows (what a frame graph replays), in its four phases, each public for the
        benchmarks' per-phase timings: `frame_inputs`, `sample_codebook0`, `predict_residual_codes`, `talker_step`."""
        embeds, counters = self.frame_inputs(B)
        c0 = self.sample_codebook0(B, counters, embeds[0])
        codes = self.predict_residual_codes(B, c0, counters, embeds)
        self.talker_step(B, c0, codes, frame_sum(embeds))

    def frame_inputs(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The frame's buffer for its 16 codes' embedding rows [16, B, H] (each gathered by the draw of its code)
        and its draws' noise counters (these + the codebook)."""
        embeds = torch.empty(16, B, self.model.talker.config.hidden_size, dtype=self.dtype, device=self.device)
        return embeds, self.state.steps[:B] * 16

    def sample_codebook0(self, B: int, counters: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Codebook 0's codes, their embedding rows into `embed`."""
        s, talker = self.state, self.model.talker
        tc = talker.config
        procs = TalkerProcessors(s.seen[:B], s.penalty[:B], s.steps[:B], self.suppress, tc.codec_eos_token_id,
                                 MIN_NEW_TOKENS)
        return sample_tokens(self.head_logits(s.hidden[:B], talker.codec_head.weight), s.talker_sampler.prefix(B),
                             s.seeds[:B], counters, procs, gather=[(talker.model.codec_embedding.weight, embed)])

    def predict_residual_codes(self, B: int, c0: torch.Tensor, counters: torch.Tensor,
                                embeds: torch.Tensor) -> list[torch.Tensor]:
        """The 15 code-predictor steps with their sampling; returns the 16 codes, their embedding rows in
        `embeds` [16, B, H] (embeds[0]: codebook 0's, given)."""
        s, cp = self.state, self.model.talker.code_predictor
        seeds, sampler = s.seeds[:B], s.cp_sampler.prefix(B)
        # Positions 0 and 1 (talker hidden, Ec(c0)) in one pass, then one position per code.
        x = torch.stack([s.hidden[:B], embeds[0]], dim=1).view(2 * B, -1)
        h, norm = self._code_predictor(x, self.cp_first[0][: 2 * B], self.cp_first[1][: 2 * B], decode=False,
                                       keep=slice(1, None, 2), pairs=True)
        logits = self.head_logits(h, cp.lm_head[0].weight, norm)
        codes = [c0]
        for g in range(cp.config.num_code_groups - 1):
            gather, x, step = self.cp_gather(g, embeds)
            codes.append(sample_tokens(logits, sampler, seeds, counters, offset=g + 1, gather=gather))
            if g < cp.config.num_code_groups - 2:
                logits = self._cp_logits(x, self.row_ids[:B], self.cp_positions[g + 2, :B], cp.lm_head[g + 1].weight,
                                         **step)
        return codes

    def cp_gather(self, g: int, embeds: torch.Tensor) -> tuple[list, torch.Tensor, dict]:
        """What the code predictor's draw g gathers (sample_tokens' `gather`) and what its next step takes: the
        code's embedding row into embeds[g + 1]; but for the last draw, with cp_input_tables the next step's input
        projected into a buffer of its own, with cp_qkv_tables that input's first qkv product into another ->
        (gather, the next step's input, _code_predictor's keywords for it)."""
        cp = self.model.talker.code_predictor
        gather = [(cp.model.codec_embedding[g].weight, embeds[g + 1])]
        x, step = embeds[g + 1], {}
        if g == cp.config.num_code_groups - 2:
            return gather, x, step

        def into_buffer(table: torch.Tensor) -> torch.Tensor:
            gather.append((table, torch.empty(embeds.shape[1], table.shape[1], dtype=self.dtype, device=self.device)))
            return gather[-1][1]

        if self.cp_input_tables is not None:
            x, step["projected"] = into_buffer(self.cp_input_tables[g]), True
        if self.cp_qkv_tables is not None:
            step["qkv0"] = into_buffer(self.cp_qkv_tables[g])
        return gather, x, step

    def _cp_logits(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, head: torch.Tensor,
                   projected: bool = False, qkv0: torch.Tensor | None = None) -> torch.Tensor:
        """A code-predictor decode step over x (as _code_predictor) and its logits through `head` in fp32: on the
        layer tail with the head the last phase of the step's last launch where the tail takes the step
        (docs/perf-notes.md, entry 98), else the decoder's other kernels, then head_logits."""
        if not projected:
            x = self.model.talker.code_predictor.small_to_mtp_projection(x)
        if self.decode_modes["decode"] and not self.cp.fuses(x.shape[0], self.decode_modes["fused"]):
            logits = self.cp.decode_logits(x, rows, positions, self.cp_cache, head, qkv0)
            if logits is not None:
                return logits
        h, norm = self._code_predictor(x, rows, positions, projected=True, qkv0=qkv0)
        return self.head_logits(h, head, norm)

    def _code_predictor(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, decode: bool = True,
                        keep: slice = slice(None), projected: bool = False, qkv0: torch.Tensor | None = None,
                        pairs: bool = False) -> tuple[torch.Tensor, tuple | None]:
        """The code predictor over x (talker width, or its own with `projected`: looked up in cp_input_tables; with
        `qkv0` its first qkv product, looked up in cp_qkv_tables; `pairs`: its first pass, each row's positions 0
        and 1), the tokens `keep` of its output -> (h, None) with h normed, or on the fused products (residual
        stream, (final norm, its sums of squares or None)): the heads' products apply the norm."""
        if not projected:
            x = self.model.talker.code_predictor.small_to_mtp_projection(x)
        fused = self.decode_modes["fused"]
        decode, pairs = decode and self.decode_modes["decode"], pairs and self.decode_modes["decode"]
        if self.cp.fuses(x.shape[0], fused):
            h, squares = self.cp(x, rows, positions, self.cp_cache, decode, fused, final_norm=False, qkv0=qkv0,
                                 pairs=pairs)
            return h[keep], (self.cp.final_norm, None if squares is None else squares[:, keep])
        return self.cp(x, rows, positions, self.cp_cache, decode, fused, qkv0=qkv0, pairs=pairs)[keep], None

    def talker_step(self, B: int, c0: torch.Tensor, codes: list[torch.Tensor], frame: torch.Tensor) -> None:
        """Feeds the frame plus this step's trailing text (TTS_PAD once used up) and updates the row state."""
        s, talker = self.state, self.model.talker
        steps = s.steps[:B]
        in_text = steps < s.trailing_len[:B]
        text_id = s.trailing_ids[:B].gather(1, steps.clamp(max=s.trailing_ids.shape[1] - 1)[:, None])[:, 0]
        text_id = torch.where(in_text, text_id, self.model.config.tts_pad_token_id)
        x = frame + talker.embed_text(text_id).float()
        new_hidden = self.talker(x, self.row_ids[:B], s.positions[:B], self.cache,
                                 **self.decode_modes)
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
        """The fast path's raw logits for a fixed history, computed as generation computes them (the prompt's
        prefill, then one decode step per frame for the talker and per code for the code predictor, with the
        engine's kernels and settings): talker [T + 1, V] and code predictor [T, 15, 2048], as
        q3tts.teacher_forcing returns them. Uses row 0 of the talker cache and the code predictor's rows: call
        with no rows admitted."""
        talker, cp = self.model.talker, self.model.talker.code_predictor
        codes = codes.to(self.device)
        T, L = codes.shape[0], prompt.embeds.shape[0]
        embeds = [talker.model.codec_embedding(codes[:, 0])]
        embeds += [cp.model.codec_embedding[g](codes[:, g + 1]) for g in range(cp.config.num_code_groups - 1)]
        frame = frame_sum(torch.stack(embeds))
        trailing = torch.tensor(prompt.trailing_ids + [self.model.config.tts_pad_token_id] * T, device=self.device)
        steps = frame + talker.embed_text(trailing[:T]).float()
        if L + T > self.max_context:
            raise ValueError(f"{L + T} positions exceed the engine's max_context {self.max_context}")
        self.grow(0, L + T)
        positions = torch.arange(L + T, device=self.device, dtype=torch.int32)
        hidden = [self.talker(prompt.embeds.to(self.device).float(), torch.zeros_like(positions[:L]), positions[:L],
                              self.cache)[-1:]]
        for t in range(T):
            hidden.append(self.talker(steps[t:t + 1], self.row_ids[:1], positions[L + t:L + t + 1], self.cache,
                                      **self.decode_modes))
        self.release_rows([0])
        hidden = torch.cat(hidden)
        talker_logits = self.head_logits(hidden, talker.codec_head.weight)
        cp_logits = []
        for t in range(T):  # one frame at a time, as a single stream's code predictor runs
            x = torch.stack([hidden[t:t + 1], embeds[0][t:t + 1]], dim=1).view(2, -1)
            h, norm = self._code_predictor(x, self.cp_first[0][:2], self.cp_first[1][:2], decode=False,
                                           keep=slice(1, None, 2), pairs=True)
            logits = [self.head_logits(h, cp.lm_head[0].weight, norm)]
            for g in range(cp.config.num_code_groups - 2):
                tables, code = self.cp_input_tables, codes[t:t + 1, g + 1]
                x = embeds[g + 1][t:t + 1] if tables is None else tables[g][code]
                qkv0 = None if self.cp_qkv_tables is None else self.cp_qkv_tables[g][code]
                logits.append(self._cp_logits(x, self.row_ids[:1], self.cp_positions[g + 2, :1],
                                              cp.lm_head[g + 1].weight, projected=tables is not None, qkv0=qkv0))
            cp_logits.append(torch.stack(logits, dim=1))
        return talker_logits, torch.cat(cp_logits)


def frame_sum(embeds: torch.Tensor) -> torch.Tensor:
    """The frame embedding F(c) = Ec(c0) + sum_j Ecp[j](c_j+1) from the codes' rows embeds [16, ..., H]: added in
    that order in fp32 (as the reference loop). On CUDA, cumsum over the first axis scans in order in fp32: 2
    kernels where adding one by one takes 30; the CPU's cumsum accumulates in double, so there they are added one
    by one."""
    if embeds.is_cuda:
        return embeds.float().cumsum(0)[-1]
    frame = embeds[0].float()
    for e in embeds[1:]:
        frame = frame + e.float()
    return frame
