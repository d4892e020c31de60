"""The model runner: owns every device tensor of the fast decode path and runs one frame for all rows.

Rows 0..B-1 of the static state are the running sequences (the engine keeps them compact). One frame =
sample codebook 0 from each row's last talker hidden state, run the whole 15-step code predictor with its
sampling, and feed the frame back through the talker (frame.py). On CUDA the frame is captured as one graph per
batch bucket at start-up (largest first, one memory pool, here); padding rows of a bucket are finished rows that
write only to the scratch KV block 0. Nothing in the frame reads back to the host: EOS and length limits set
`done` on the device, and the host collects codes through pinned buffers and events, one frame behind.

The talker's KV cache is paged (`kv_blocks.KVBlocks` says which blocks each row holds); a row grows a block at
a time as it runs, and can be swapped out to host memory and back into any free row unchanged (kv_rows.py): that
is how the engine preempts a row when the cache is full. Rows are admitted by prefill (prefill.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.norm import add_rmsnorm
from ...models.qwen3_tts import Qwen3TTSModel
from ...sampling import suppressed_ids
from ..config import EngineConfig
from .frame import FrameStep
from .graphs import capture_buckets, replay_or_run, side_stream
from .kv_rows import KVRows
from .prefill import Prefill
from .prefix_cache import PrefixCache
from .row_state import RowState
from .transformer import FlatDecoder, PagedCache

# Calls of these many tokens keep cuBLAS in a talker wider than 1,024 (1.7B's): see ModelRunner.__init__
WIDE_TALKER_UNFUSED_ROWS = (2,)


class ModelRunner(KVRows, Prefill, FrameStep):
    """The device side of one engine: every device tensor of the fast decode path (the flat talker and code
    predictor, the paged caches, the rows' static state) and what runs on them, in three parts: rows and their KV
    blocks (kv_rows.py), admission by prefill (prefill.py) and the frame (frame.py); here the construction and the
    CUDA graphs of the frame and prefill buckets."""

    def __init__(self, model: Qwen3TTSModel, config: EngineConfig | None = None, kv_blocks: int | None = None):
        """kv_blocks: the KV cache's size (default: the config's, without a GPU memory budget; the engine sizes
        it from its budget with `allocate_kv_cache`)."""
        self.model, self.config = model, config or EngineConfig()
        cfg = self.config
        talker = model.talker
        tc, cc = talker.config, talker.code_predictor.config
        self.device = talker.codec_head.weight.device
        self.dtype = talker.codec_head.weight.dtype
        self.max_context = cfg.context_for(tc.max_position_embeddings)
        # The matrix-vector kernel at two rows is slower than cuBLAS for 1.7B's talker (2,048 wide), not for 0.6B's
        # (docs/perf-notes.md, entries 51 and 69: 1.77 -> 1.95 ms): the wider talker keeps cuBLAS there.
        self.talker = FlatDecoder(talker.model.layers, talker.model.norm.weight, tc.rms_norm_eps,
                                  tc.num_attention_heads, tc.head_dim, talker.model.inv_freq,
                                  unfused_rows=WIDE_TALKER_UNFUSED_ROWS if tc.hidden_size > 1024 else ())
        cp = talker.code_predictor
        self.cp = FlatDecoder(cp.model.layers, cp.model.norm.weight, cc.rms_norm_eps, cc.num_attention_heads,
                              cc.head_dim, cp.model.inv_freq)
        # The code predictor's 16 positions per frame: one block per row, block r for row r.
        self.cp_cache = PagedCache.allocate(cc.num_hidden_layers, cfg.max_rows, cc.num_code_groups,
                                            cc.num_key_value_heads, cc.head_dim, cfg.max_rows, 1, self.dtype,
                                            self.device)
        self.cp_cache.block_table.copy_(torch.arange(cfg.max_rows, device=self.device, dtype=torch.int32)[:, None])
        self.state = RowState(cfg.max_rows, tc.hidden_size, tc.vocab_size, cfg.max_trailing, self.dtype,
                              self.device)
        self.suppress = suppressed_ids(tc.vocab_size, tc.codec_eos_token_id, self.device)
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
        self.fp32_head = _probe_fp32_head(self.device, self.dtype)
        # How the decode steps run (EngineConfig.fused_decode); the fused products keep fp32 on cuBLAS, whose sums
        # the reference loop shares.
        self.decode_modes = {"decode": cfg.fused_decode != "off",
                        "fused": cfg.fused_decode == "all" and self.dtype != torch.float32}
        # On the fused path a narrower code predictor's input projection (1.7B: 2,048 -> 1,024 with bias) is looked up
        # instead of run: the projected embedding rows of its codebooks 1-14, computed once (the sampler gathers
        # them; the same products, summed in another order). The fp32 and unfused paths run it as the reference.
        self.cp_input_tables = self.prepare_cp_input_tables() if self.decode_modes["fused"] else None
        # Likewise the code predictor's first layer (input norm, qkv product) over those inputs: its decode steps
        # look their qkv up (docs/perf-notes.md, entry 90). Not on a CPU, where computing the tables (~240 GFLOP)
        # costs what ~30,000 one-row steps save.
        on_gpu = self.device.type == "cuda"
        self.cp_qkv_tables = self.prepare_cp_qkv_tables() if self.decode_modes["fused"] and on_gpu else None
        self.cache: PagedCache | None = None
        self.allocate_kv_cache(kv_blocks or cfg.kv_blocks(self.kv_bytes_per_block, self.max_context, None))
        self.prefix_cache = PrefixCache(int(cfg.prefix_cache_gb * 2**30)) if cfg.prefix_cache_gb else None

    @torch.no_grad()
    def prepare_cp_input_tables(self) -> list[torch.Tensor] | None:
        """cp_input_tables: codebooks 1-14's embedding rows through the code predictor's input projection (None
        where it has none)."""
        cp = self.model.talker.code_predictor
        if not isinstance(cp.small_to_mtp_projection, torch.nn.Linear):
            return None
        return [cp.small_to_mtp_projection(e.weight).contiguous() for e in cp.model.codec_embedding[:-1]]

    @torch.no_grad()
    def prepare_cp_qkv_tables(self) -> list[torch.Tensor]:
        """cp_qkv_tables: the code predictor's first qkv product (input norm, then the product: the kernels of its
        64-row steps) of each of its decode inputs, codebooks 1-14's embedding rows (projected where it projects):
        14 x [2,048, 4,096] (235 MB in bf16 at the real sizes)."""
        first = self.cp.layers[0]
        inputs = self.cp_input_tables or [e.weight for e in self.model.talker.code_predictor.model.codec_embedding[:-1]]
        return [F.linear(add_rmsnorm(x, None, first.input_norm, self.cp.eps, self.dtype)[0], first.qkv)
                for x in inputs]

    def bucket(self, num_rows: int) -> int:
        """The captured batch size that serves `num_rows` rows (exactly `num_rows` when running eagerly)."""
        if not self.graphs:
            return num_rows
        return next(b for b in self.config.buckets if b >= num_rows)

    @torch.no_grad()
    def step(self, num_rows: int) -> None:
        """One frame for rows 0..num_rows-1 (the padding rows of the bucket run too, harmlessly)."""
        replay_or_run(self.graphs, self.frame, self.bucket(num_rows))

    @torch.no_grad()
    def capture_graphs(self, stream: torch.cuda.Stream | None = None) -> None:
        """Captures every bucket, largest first, into one memory pool, on `stream` (default: a side stream; see
        graphs.py). Call after `allocate_kv_cache` and before admitting any row."""
        if self.device.type != "cuda" or not self.config.use_graphs:
            return
        stream = stream or side_stream()
        self.graphs = capture_buckets(self.frame, self.config.buckets, stream)
        self.prefill_graphs = capture_buckets(self.prefill, self.config.prefill_buckets, stream)
        self.reset_state()

    def reset_state(self) -> None:
        """Every row back to padding (after graph capture or memory profiling ran frames on the static state)."""
        cfg, tc = self.config, self.model.talker.config
        self.state = _copy_into(self.state, RowState(cfg.max_rows, tc.hidden_size, tc.vocab_size, cfg.max_trailing,
                                                     self.dtype, self.device))












def _copy_into(old: RowState, new: RowState) -> RowState:
    """Resets `old` in place to `new`'s values (graphs keep pointing at `old`'s tensors)."""
    for target, value in zip(old.tensors(), new.tensors()):
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
