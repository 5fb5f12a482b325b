"""The deployments the CONCUR paper ran, and a tiny one for tests.

Model numbers come from the models' Hugging Face config.json files; parameter counts are
computed from them (they reproduce the published totals: Qwen3-32B 32.8B, DeepSeek-V3
671B / 37B active). GPU numbers are NVIDIA's H100 SXM datasheet. Sources and the
arithmetic are in docs/simulator.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from ...engines.protocol import Tokenizer
from .cost import Deployment, GpuSpec, ModelSpec
from .scheduler import SimEngine

MiB = 1 << 20


def _qwen3_32b() -> ModelSpec:
    # Qwen/Qwen3-32B config.json
    layers, hidden, heads, kv_heads, head_dim = 64, 5120, 64, 8, 128
    inter, vocab = 25600, 151936
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * inter  # gate, up, down
    norms = 2 * hidden + 2 * head_dim  # input/post-attention RMSNorm, q_norm, k_norm
    matmul = layers * (attn + mlp)
    total = matmul + layers * norms + hidden + 2 * vocab * hidden  # untied embeddings
    return ModelSpec(
        name="Qwen3-32B",
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        params_total=float(total),
        params_active=float(matmul),
        max_context=40960,  # max_position_embeddings
    )


def _deepseek_v3() -> ModelSpec:
    # deepseek-ai/DeepSeek-V3 config.json
    layers, hidden, heads, vocab = 61, 7168, 128, 129280
    q_lora, kv_lora, nope, rope, v_dim = 1536, 512, 128, 64, 128
    dense_inter, moe_inter, n_experts, top_k, n_shared = 18432, 2048, 256, 8, 1
    dense_layers = 3  # first_k_dense_replace
    moe_layers = layers - dense_layers
    attn = (
        hidden * q_lora  # q_a_proj
        + q_lora * heads * (nope + rope)  # q_b_proj
        + hidden * (kv_lora + rope)  # kv_a_proj_with_mqa
        + kv_lora * heads * (nope + v_dim)  # kv_b_proj
        + heads * v_dim * hidden  # o_proj
    )
    expert = 3 * hidden * moe_inter
    router = hidden * n_experts
    dense_mlp = 3 * hidden * dense_inter
    active = (
        layers * attn
        + dense_layers * dense_mlp
        + moe_layers * (router + n_shared * expert + top_k * expert)
    )
    total_matmul = (
        layers * attn
        + dense_layers * dense_mlp
        + moe_layers * (router + n_shared * expert + n_experts * expert)
    )
    norms = layers * (2 * hidden + q_lora + kv_lora) + hidden
    embeddings = 2 * vocab * hidden  # embed_tokens and lm_head, untied
    return ModelSpec(
        name="DeepSeek-V3",
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        head_dim=nope + rope,
        vocab=vocab,
        params_total=float(total_matmul + norms + embeddings),
        params_active=float(active),
        max_context=163840,
        weight_bytes_per_param=1.0,  # fp8 checkpoint (block-wise e4m3)
        extra_weight_bytes=float(embeddings + norms),  # kept in bf16: one more byte each
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        v_head_dim=v_dim,
        n_routed_experts=n_experts,
        experts_per_token=top_k,
        expert_params=float(moe_layers * expert),
    )


QWEN3_32B = _qwen3_32b()
DEEPSEEK_V3 = _deepseek_v3()

# NVIDIA H100 SXM5 80GB datasheet: 989 TFLOP/s dense BF16, 1979 dense FP8 (the datasheet's
# 1979 / 3958 are with sparsity), 3.35 TB/s HBM3, NVLink 900 GB/s total (450 each way),
# PCIe Gen5 x16 64 GB/s each way. nvidia-smi reports 81559 MiB.
H100_SXM = GpuSpec(
    name="H100-SXM-80GB",
    flops_bf16=989e12,
    flops_fp8=1979e12,
    hbm_bytes_per_s=3.35e12,
    memory_bytes=81559 * MiB,
    nvlink_bytes_per_s=450e9,
    allreduce_latency_s=10e-6,
    gpus_per_node=8,
    internode_bytes_per_s=50e9,  # ConnectX-7 400 Gb/s per GPU
    internode_latency_s=25e-6,
    pcie_bytes_per_s=50e9,  # achieved pinned-memory copies, below the 64 GB/s link rate
)

# A small fake model and accelerator: cheap iterations (~ms) and a 20k-token pool, so that
# tests exercise eviction, chunking and retraction with short prompts.
TINY_MODEL = ModelSpec(
    name="tiny",
    layers=4,
    hidden=256,
    heads=4,
    kv_heads=2,
    head_dim=64,
    vocab=1024,
    params_total=4e6,
    params_active=3.5e6,
    max_context=16384,
)
TINY_GPU = GpuSpec(
    name="tiny-accelerator",
    flops_bf16=1e12,
    flops_fp8=1e12,
    hbm_bytes_per_s=100e9,
    memory_bytes=float(1 << 30),
    nvlink_bytes_per_s=10e9,
    allreduce_latency_s=10e-6,
    pcie_bytes_per_s=1e9,
)

DEPLOYMENTS: dict[str, Deployment] = {
    "qwen3-32b-tp2": Deployment("qwen3-32b-tp2", QWEN3_32B, H100_SXM, tp=2),
    "qwen3-32b-tp4": Deployment("qwen3-32b-tp4", QWEN3_32B, H100_SXM, tp=4),
    "qwen3-32b-tp8": Deployment("qwen3-32b-tp8", QWEN3_32B, H100_SXM, tp=8),
    "deepseek-v3-tp16": Deployment(
        "deepseek-v3-tp16",
        DEEPSEEK_V3,
        H100_SXM,
        tp=16,
        layer_overhead_s=60e-6,  # MLA + MoE routing/dispatch: more kernels per layer
        notes="2 nodes x 8 H100",
    ),
    # The paper states ~6.67 GB of KV cache per 4,096-token DeepSeek-V3 request (1.63 MB a
    # token); spread over 16 GPUs beside the FP8 weights that leaves ~280K tokens of pool,
    # fewer than the ~452K an MLA cache replicated per GPU gives. The paper bench's preset.
    "deepseek-v3-tp16-paper": Deployment(
        "deepseek-v3-tp16-paper",
        DEEPSEEK_V3,
        H100_SXM,
        tp=16,
        layer_overhead_s=60e-6,
        max_total_tokens=280_000,
        notes="2 nodes x 8 H100; pool capped to the paper's 6.67 GB per 4,096 tokens",
    ),
    "tiny-cpu": Deployment(
        "tiny-cpu",
        TINY_MODEL,
        TINY_GPU,
        tp=1,
        runtime_reserved_bytes=0.0,
        prefill_overhead_s=0.002,
        decode_overhead_s=0.001,
        layer_overhead_s=0.0,
        max_total_tokens=20_000,
    ),
}

_DEPLOYMENT_FIELDS = {f.name for f in fields(Deployment)}


def deployment(name: str, **changes: Any) -> Deployment:
    if name not in DEPLOYMENTS:
        raise ValueError(f"unknown simulator preset {name!r}; choose from {sorted(DEPLOYMENTS)}")
    return DEPLOYMENTS[name].with_(**changes) if changes else DEPLOYMENTS[name]


def make_sim_engine(
    preset_name: str,
    tokenizer: Tokenizer,
    model: Callable[[list[int]], list[int]],
    **overrides: Any,
) -> SimEngine:
    """A SimEngine for a named deployment. Overrides that name Deployment fields
    (mem_fraction_static, max_total_tokens, compute_efficiency, ...) change the deployment;
    the rest go to SimEngine (hicache_tokens, chunked_prefill_size, ...)."""
    dep_changes = {k: v for k, v in overrides.items() if k in _DEPLOYMENT_FIELDS}
    engine_kwargs = {k: v for k, v in overrides.items() if k not in _DEPLOYMENT_FIELDS}
    return SimEngine(deployment(preset_name, **dep_changes), tokenizer, model, **engine_kwargs)
