"""Teacher-forced logits: the raw logits a model gives when fed a fixed token history.

Comparing implementations by free-running greedy codes breaks at the first near-tie; feeding both the same
history and comparing logits measures numerical faithfulness at every step (used by the equivalence tests
and the GPU faithfulness checks).
"""

from __future__ import annotations

import torch

from .models.talker import Talker
from .request.prompt import Prompt


@torch.no_grad()
def teacher_forced_logits(talker: Talker, prompt: Prompt, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes: [T, 16] frames to feed. Returns the raw talker logits [T + 1, V] (row s predicts codebook 0 of
    frame s; row T is the logits after the last frame) and the code-predictor logits [T, 15, 2048] (head g
    predicts codebook g + 1 of frame s given codebooks 0..g)."""
    device = talker.codec_head.weight.device
    codes = codes.to(device)
    T, L = codes.shape[0], prompt.embeds.shape[0]
    steps = torch.arange(T, device=device)
    trailing = torch.where((steps < prompt.trailing.shape[0])[:, None],
                           prompt.trailing[steps.clamp(max=prompt.trailing.shape[0] - 1)], prompt.pad)
    x = torch.cat([prompt.embeds, talker.embed_frame(codes) + trailing])[None]
    positions = torch.arange(L + T, device=device)[None]
    cache = talker.new_cache(1, L + T)
    hidden = talker.model(x, positions, cache, torch.zeros(1, dtype=torch.long, device=device))[0, L - 1:]
    talker_logits = talker.codec_head(hidden).float()  # [T + 1, V]
    if T == 0:
        return talker_logits, torch.zeros(0, 15, talker.code_predictor.config.vocab_size, device=device)
    return talker_logits, _code_predictor_logits(talker, hidden[:T], codes)


def _code_predictor_logits(talker: Talker, hidden: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    cp = talker.code_predictor
    T = codes.shape[0]
    inputs = [hidden, talker.embed_codec(codes[:, 0])]
    inputs += [cp.model.codec_embedding[g](codes[:, g + 1]) for g in range(cp.config.num_code_groups - 2)]
    x = torch.stack(inputs, dim=1)  # [T, 16, H]
    positions = torch.arange(x.shape[1], device=x.device).expand(T, -1)
    cache = cp.new_cache(T)
    h = cp(x, positions, cache, torch.arange(T, device=x.device))
    return torch.stack([cp.lm_head[g](h[:, g + 1]) for g in range(cp.config.num_code_groups - 1)], dim=1).float()
