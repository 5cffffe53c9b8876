"""Model configuration of the hybrid KDA + MLA decoder (the Kimi Linear architecture).

`ModelConfig` is the single typed description of a model. It converts to and from the
`config.json` of a Hugging Face `kimi_linear` checkpoint directory (`from_hf_dict` / `to_hf_dict`),
and mirrors `configs/model/*.yaml` field for field (`load_model_config`).

Layer words used across the project:
- mixer: the token-mixing half of a layer, `"kda"` (Kimi Delta Attention, a linear-attention
  layer with one fixed-size recurrent state per sequence) or `"mla"` (multi-head latent attention,
  one cache entry [c_kv, k_rope] per token).
- mlp: the channel-mixing half, `"dense"` (SwiGLU) or `"moe"` (routed experts + shared experts).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIXER_TYPES = ("kda", "mla")
MLP_TYPES = ("dense", "moe")

# transformers' `kimi_linear` spells layer kinds differently; these are its words.
_HF_MIXER = {"linear_attention": "kda", "full_attention": "mla"}
_HF_MLP = {"dense": "dense", "sparse": "moe"}


def hybrid_layer_types(num_layers: int, pattern: str = "KKKM") -> list[str]:
    """Mixer kinds for `num_layers` layers repeating `pattern` (K = kda, M = mla).

    The default is Kimi Linear's 3 KDA : 1 MLA ratio.
    """
    if not pattern or set(pattern) - {"K", "M"}:
        raise ValueError(f"layer pattern {pattern!r} must be a non-empty string of 'K' (kda) and 'M' (mla)")
    return ["kda" if pattern[i % len(pattern)] == "K" else "mla" for i in range(num_layers)]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and hyper-parameters of a hybrid KDA/MLA decoder-only LM."""

    vocab_size: int
    """Number of token ids (embedding rows and lm_head outputs)."""
    hidden_size: int
    """Residual stream width."""
    num_hidden_layers: int
    """Number of decoder layers."""
    layer_types: list[str]
    """Mixer per layer: "kda" or "mla" (length num_hidden_layers)."""
    mlp_layer_types: list[str]
    """MLP per layer: "dense" or "moe" (length num_hidden_layers)."""
    intermediate_size: int
    """Hidden width of the dense SwiGLU MLP."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with lm_head."""

    # KDA (linear attention)
    linear_num_heads: int = 4
    """KDA heads."""
    linear_head_dim: int = 32
    """KDA key and value head dimension (dk = dv)."""
    linear_conv_kernel_dim: int = 4
    """Kernel of the short causal depthwise convolution on q, k, v."""

    # MLA (full attention)
    num_attention_heads: int = 4
    """MLA heads."""
    kv_lora_rank: int = 32
    """Latent dimension d_c of the compressed KV (cached per token)."""
    q_lora_rank: int | None = None
    """Rank of the low-rank query path; None = a full q_proj."""
    qk_nope_head_dim: int = 16
    """Per-head query/key dimension computed from the latent."""
    qk_rope_head_dim: int = 8
    """Dimension d_r of the key part shared by heads (cached per token)."""
    v_head_dim: int = 16
    """Per-head value dimension."""
    mla_use_nope: bool = True
    """Kimi Linear's NoPE MLA: the shared key part gets no rotary embedding."""
    rope_theta: float = 10000.0
    """RoPE base, used only when mla_use_nope is False."""
    mla_output_gate: bool = False
    """Gated MLA: multiply the attention output by sigmoid(o_gate_proj(x)) before o_proj."""

    # MoE
    num_experts: int = 8
    """Routed experts per MoE layer."""
    num_experts_per_token: int = 2
    """Experts each token is routed to (top-k)."""
    num_expert_group: int = 1
    """Groups the routed experts are split into for group-limited routing."""
    topk_group: int = 1
    """Groups a token may route into."""
    num_shared_experts: int = 1
    """Shared experts (always applied), each of width moe_intermediate_size."""
    moe_intermediate_size: int = 32
    """Hidden width of one expert."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the routed experts' combined weights."""
    moe_renormalize: bool = True
    """Renormalise the top-k routing weights to sum to one."""

    # Special tokens
    bos_token_id: int | None = None
    """Beginning-of-sequence id."""
    eos_token_id: int | None = None
    """End-of-sequence id."""
    pad_token_id: int | None = None
    """Padding id."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "linear_num_heads",
                     "linear_head_dim", "linear_conv_kernel_dim", "num_attention_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name}={value!r}, expected a positive integer")
        if self.qk_rope_head_dim < 0:
            raise ValueError(f"model config: qk_rope_head_dim={self.qk_rope_head_dim}, expected >= 0")
        if not self.mla_use_nope and self.qk_rope_head_dim % 2:
            raise ValueError(f"model config: qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE "
                             f"(mla_use_nope=False)")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"model config: q_lora_rank={self.q_lora_rank}, expected None or a positive integer")
        # Lists may arrive as OmegaConf ListConfig or tuples: store plain lists.
        object.__setattr__(self, "layer_types", [str(t) for t in self.layer_types])
        object.__setattr__(self, "mlp_layer_types", [str(t) for t in self.mlp_layer_types])
        for name, kinds, allowed in (("layer_types", self.layer_types, MIXER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES)):
            if len(kinds) != self.num_hidden_layers:
                raise ValueError(f"model config: {name} has {len(kinds)} entries, expected num_hidden_layers="
                                 f"{self.num_hidden_layers}")
            for i, kind in enumerate(kinds):
                if kind not in allowed:
                    raise ValueError(f"model config: unknown layer type {kind!r} at {name}[{i}], "
                                     f"expected one of {allowed}")
        if "moe" in self.mlp_layer_types:
            if not 0 < self.num_experts_per_token <= self.num_experts:
                raise ValueError(f"model config: num_experts_per_token={self.num_experts_per_token}, expected "
                                 f"1..num_experts={self.num_experts}")
            if self.num_experts % self.num_expert_group:
                raise ValueError(f"model config: num_experts={self.num_experts} is not divisible by "
                                 f"num_expert_group={self.num_expert_group}")
            if not 0 < self.topk_group <= self.num_expert_group:
                raise ValueError(f"model config: topk_group={self.topk_group}, expected 1..num_expert_group="
                                 f"{self.num_expert_group}")
            per_group = self.num_experts // self.num_expert_group
            if self.num_expert_group > 1 and per_group < 2:
                raise ValueError(f"model config: group-limited routing scores a group by its top-2 experts, "
                                 f"but num_experts/num_expert_group={per_group}")
            if self.topk_group * per_group < self.num_experts_per_token:
                raise ValueError(f"model config: topk_group={self.topk_group} groups of {per_group} experts cannot "
                                 f"supply num_experts_per_token={self.num_experts_per_token}")
        if self.bos_token_id is not None or self.eos_token_id is not None or self.pad_token_id is not None:
            for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
                value = getattr(self, name)
                if value is not None and not 0 <= value < self.vocab_size:
                    raise ValueError(f"model config: {name}={value}, expected an id in [0, {self.vocab_size})")

    # ---- derived sizes ---------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of MLA: nope part + shared rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Width of one MLA cache entry per token and layer: [c_kv, k_rope]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mla"]

    @property
    def linear_qkv_dim(self) -> int:
        """Width of each of KDA's q, k and v projections (heads x head_dim)."""
        return self.linear_num_heads * self.linear_head_dim

    def num_parameters(self) -> int:
        """Trainable parameter count from the shape alone (no tensors are built; buffers excluded)."""
        d, counts = self.hidden_size, 0
        qkv = self.linear_qkv_dim
        kda = (3 * d * qkv + 3 * qkv * self.linear_conv_kernel_dim + 2 * (d * self.linear_head_dim + self.linear_head_dim * qkv)
               + qkv + self.linear_num_heads + d * self.linear_num_heads + self.linear_head_dim + qkv * d)
        h = self.num_attention_heads
        q = (d * h * self.qk_head_dim if self.q_lora_rank is None
             else d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim)
        mla = (q + d * self.mla_latent_dim + self.kv_lora_rank + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
               + h * self.v_head_dim * d + (d * h * self.v_head_dim if self.mla_output_gate else 0))
        dense = 3 * d * self.intermediate_size
        moe = 3 * d * self.moe_intermediate_size * (self.num_experts + self.num_shared_experts) + self.num_experts * d
        for mixer, mlp in zip(self.layer_types, self.mlp_layer_types):
            counts += (kda if mixer == "kda" else mla) + (dense if mlp == "dense" else moe) + 2 * d
        counts += self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        return counts

    # ---- conversions ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a `kimi_linear` config.json (Moonshot's original keys or transformers' names)."""
        if hf.get("model_type", "kimi_linear") != "kimi_linear":
            raise ValueError(f"config.json: model_type={hf.get('model_type')!r}, expected 'kimi_linear'")
        num_layers = hf["num_hidden_layers"]
        linear = hf.get("linear_attn_config") or {}
        if hf.get("layer_types") is not None:
            raw = list(hf["layer_types"])
        elif "kda_layers" in linear and "full_attn_layers" in linear:
            raw = [None] * num_layers  # the checkpoint numbers layers from 1
            for i in linear["full_attn_layers"]:
                raw[i - 1] = "full_attention"
            for i in linear["kda_layers"]:
                raw[i - 1] = "linear_attention"
        else:
            raise ValueError("config.json: neither layer_types nor linear_attn_config.{kda_layers,full_attn_layers}")
        layer_types = [_HF_MIXER.get(t, t) if isinstance(t, str) else t for t in raw]
        if hf.get("mlp_layer_types") is not None:
            mlp_types = [_HF_MLP.get(t, t) for t in hf["mlp_layer_types"]]
        else:
            first_dense = hf.get("first_k_dense_replace", 1)
            mlp_types = ["dense" if i < first_dense else "moe" for i in range(num_layers)]
        for i, kind in enumerate(layer_types):
            if kind not in MIXER_TYPES:
                raise ValueError(f"config.json: unknown layer type {raw[i]!r} for layer {i}, expected one of "
                                 f"{sorted(_HF_MIXER)}")

        def pick(*names, default=None):
            for name in names:
                if hf.get(name) is not None:
                    return hf[name]
            return default

        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_hidden_layers=num_layers,
            layer_types=layer_types, mlp_layer_types=mlp_types, intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5), tie_word_embeddings=hf.get("tie_word_embeddings", False),
            linear_num_heads=pick("linear_num_heads", default=linear.get("num_heads", 32)),
            linear_head_dim=pick("linear_head_dim", default=linear.get("head_dim", 128)),
            linear_conv_kernel_dim=pick("linear_conv_kernel_dim", default=linear.get("short_conv_kernel_size", 4)),
            num_attention_heads=hf["num_attention_heads"], kv_lora_rank=hf["kv_lora_rank"],
            q_lora_rank=hf.get("q_lora_rank"), qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
            # transformers' kimi_linear always runs MLA without rotary embedding (NoPE).
            mla_use_nope=hf.get("mla_use_nope", True), rope_theta=hf.get("rope_theta") or 10000.0,
            mla_output_gate=hf.get("mla_output_gate", False),
            num_experts=pick("num_experts", "num_local_experts", "n_routed_experts", default=1),
            num_experts_per_token=pick("num_experts_per_token", "num_experts_per_tok", default=1),
            num_expert_group=pick("num_expert_group", "n_group", default=1),
            topk_group=pick("topk_group", default=1),
            num_shared_experts=pick("num_shared_experts", "n_shared_experts", default=0),
            moe_intermediate_size=pick("moe_intermediate_size", default=hf["intermediate_size"]),
            routed_scaling_factor=pick("routed_scaling_factor", default=1.0),
            moe_renormalize=pick("moe_renormalize", "norm_topk_prob", default=True),
            bos_token_id=hf.get("bos_token_id"), pad_token_id=hf.get("pad_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json contents in Moonshot's keys, which transformers' KimiLinearConfig also reads."""
        to_hf_mixer = {v: k for k, v in _HF_MIXER.items()}
        to_hf_mlp = {v: k for k, v in _HF_MLP.items()}
        out = {
            "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "layer_types": [to_hf_mixer[t] for t in self.layer_types],
            "mlp_layer_types": [to_hf_mlp[t] for t in self.mlp_layer_types],
            "linear_attn_config": {
                "head_dim": self.linear_head_dim, "num_heads": self.linear_num_heads,
                "short_conv_kernel_size": self.linear_conv_kernel_dim,
                "kda_layers": [i + 1 for i in self.kda_layers], "full_attn_layers": [i + 1 for i in self.mla_layers],
            },
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_attention_heads,
            "kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim, "mla_use_nope": self.mla_use_nope, "rope_theta": self.rope_theta,
            "num_experts": self.num_experts, "num_experts_per_token": self.num_experts_per_token,
            "num_expert_group": self.num_expert_group, "topk_group": self.topk_group,
            "num_shared_experts": self.num_shared_experts, "moe_intermediate_size": self.moe_intermediate_size,
            "routed_scaling_factor": self.routed_scaling_factor, "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
        }
        if self.mla_output_gate:  # our extension; absent keys keep the file loadable by transformers
            out["mla_output_gate"] = True
        return out


def load_model_config(path: str | Path, overrides: list[str] | None = None) -> ModelConfig:
    """Read a `configs/model/*.yaml` file (or a checkpoint's config.json) into a validated ModelConfig.

    YAML files are merged onto the dataclass schema with OmegaConf, so a misspelt key or a wrong
    type fails here, naming the key. `overrides` are dotlist entries such as "hidden_size=128".
    """
    path = Path(path)
    if path.suffix == ".json":
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(ModelConfig)
    merged = OmegaConf.merge(schema, OmegaConf.load(path), OmegaConf.from_dotlist(overrides or []))
    return OmegaConf.to_object(merged)
