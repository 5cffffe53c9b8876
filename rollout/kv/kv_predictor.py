"""InfiniGen's speculation for MLA: partial keys on a few rotated latent channels.

Fitted offline per MLA layer from the model's own weights (rollout/kv/kv_eviction.py calls it at
engine build and on every `load_weights`); see `PartialKeyPredictor`.
"""
from __future__ import annotations

import torch

from models.model import HybridLM, StateMixer
from models.state import SegmentBatch


class _CaptureMixer(StateMixer):
    """The plain model's mixer, recording each MLA layer's input."""

    def __init__(self, batch: SegmentBatch) -> None:
        super().__init__(batch, [None] * len(batch.new_lens), [[]] * len(batch.new_lens))
        self.inputs: dict[int, torch.Tensor] = {}

    def mla(self, index, layer, x):
        self.inputs[index] = x
        return super().mla(index, layer, x)


class PartialKeyPredictor:
    """Per MLA layer, a [latent, r] projection P so that (q P) . (k P) approximates q . k.

    Fitted offline on a random calibration text run through the model (InfiniGen's skewing, in
    MLA's absorbed space): the latents' right singular vectors give an orthogonal rotation A
    (so q A . k A = q . k), and the r rotated channels with the largest mean |q| x mean |k| are
    kept. r = the whole latent uses the identity: the predictor is then exact."""

    def __init__(self, model: HybridLM, channels: int | None, num_tokens: int, seed: int) -> None:
        cfg = model.config
        self.latent_dim = cfg.mla_latent_dim
        self.channels = min(channels or max(1, self.latent_dim // 4), self.latent_dim)
        self.exact = self.channels == self.latent_dim
        self.num_tokens, self.seed = num_tokens, seed
        self.proj: dict[int, torch.Tensor] = {}
        self.calibrate(model)

    @torch.inference_mode()
    def calibrate(self, model: HybridLM) -> None:
        device = next(model.parameters()).device
        for layer in model.config.mla_layers:
            self.proj[layer] = torch.eye(self.latent_dim, device=device)
        if self.exact:
            return
        gen = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(0, model.config.vocab_size, (self.num_tokens,), generator=gen).to(device)
        batch = SegmentBatch(new_lens=[self.num_tokens], starts=[0])
        mixer = _CaptureMixer(batch)
        model.run_layers(tokens, mixer)
        positions = batch.positions(device)
        for index, x in mixer.inputs.items():
            attn = model.model.layers[index].self_attn
            keys = attn.latent(x, positions).float()  # [T, W]
            q_nope, q_rope = attn.queries(x, positions)
            w_uk, _ = attn.up_projections()
            q_lat = torch.einsum("thn,hnc->thc", q_nope.float(), w_uk.float())
            queries = torch.cat([q_lat, q_rope.float()], dim=-1).reshape(-1, self.latent_dim)  # [T*H, W]
            rotation = torch.linalg.svd(keys, full_matrices=False).Vh.T  # [W, W] orthogonal
            weight = (queries @ rotation).abs().mean(0) * (keys @ rotation).abs().mean(0)  # [W]
            self.proj[index] = rotation[:, weight.topk(self.channels).indices.sort().values].contiguous()

    def keys(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """rows [m, W] -> partial keys [m, r]."""
        return rows.float() if self.exact else rows.float() @ self.proj[layer]

    def queries(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [..., W] -> [..., r]."""
        return q.float() if self.exact else q.float() @ self.proj[layer]
