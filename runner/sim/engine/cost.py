"""Roofline cost model of one engine iteration, and the deployments the paper ran.

An iteration takes max(compute time, memory time) for its phase, plus the tensor-parallel
all-reduces, a fixed per-iteration overhead, and (HiCache) what of the host-to-device
transfer of reloaded KV outlasts the forward it overlaps layer by layer (`overlapped`).
Every constant is in docs/simulator.md with its
source; the efficiencies and overheads are calibration knobs, not measurements.

Units: bytes, FLOP, seconds, tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

GiB = 1 << 30


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers from the model's config.json."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params_total: float  # every weight, embeddings included
    # Matmul weights one token goes through, embeddings and LM head excluded (MoE: the
    # routed experts it is sent to, not all of them). Prefill/decode FLOPs = 2 * this.
    params_active: float
    max_context: int
    weight_bytes_per_param: float = 2.0  # bf16
    extra_weight_bytes: float = 0.0  # parts stored wider (fp8 models keep embeddings bf16)
    kv_dtype_bytes: int = 2  # bf16 KV cache (SGLang's default kv_cache_dtype="auto")
    # MLA (DeepSeek): the cache holds one latent of kv_lora_rank + qk_rope_head_dim per layer
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE: routed experts, and the parameters of one routed expert summed over MoE layers
    n_routed_experts: int = 0
    experts_per_token: int = 0
    expert_params: float = 0.0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_bytes_per_token_per_gpu(self, tp: int) -> int:
        """SGLang's cell_size (model_runner.profile_max_num_token): GQA shards KV heads over
        TP ranks (at least one head per rank); MLA's latent is replicated on every rank."""
        if self.mla:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.layers * self.kv_dtype_bytes
        kv_heads = max(1, self.kv_heads // tp)
        return 2 * self.layers * kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.weight_bytes_per_param + self.extra_weight_bytes

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one forward pass over `tokens` tokens reads. Dense: all of them. MoE:
        only the routed experts some token picked; with uniform routing the expected number
        touched is E * (1 - (1 - k/E)^tokens)."""
        if not self.n_routed_experts:
            return self.weight_bytes
        e, k = self.n_routed_experts, self.experts_per_token
        touched = e * (1.0 - (1.0 - k / e) ** max(tokens, 0))
        idle = (e - touched) * self.expert_params * self.weight_bytes_per_param
        return self.weight_bytes - idle

    @property
    def prefill_attn_flops_per_pair(self) -> float:
        """FLOPs of attention for one (query token, key token) pair, all layers: QK^T and AV,
        2 FLOPs per multiply-add. MLA prefill runs as plain multi-head attention with
        qk = nope + rope and v = v_head_dim."""
        if self.mla:
            qk, v = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        else:
            qk = v = self.head_dim
        return 2.0 * self.layers * self.heads * (qk + v)

    @property
    def decode_attn_flops_per_ctx_token(self) -> float:
        """Decode attention FLOPs per cached token attended. MLA decodes in the absorbed
        form: scores over the latent (kv_lora_rank + rope), values over kv_lora_rank."""
        if self.mla:
            return 2.0 * self.layers * self.heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return self.prefill_attn_flops_per_pair


@dataclass(frozen=True)
class GpuSpec:
    name: str
    flops_bf16: float  # dense tensor-core peak, FLOP/s
    flops_fp8: float
    hbm_bytes_per_s: float
    memory_bytes: float  # what CUDA reports as total memory
    nvlink_bytes_per_s: float  # per GPU, one direction
    allreduce_latency_s: float  # one small all-reduce inside a node
    gpus_per_node: int = 8
    internode_bytes_per_s: float = 50e9  # one 400 Gb/s NIC per GPU
    internode_latency_s: float = 25e-6
    pcie_bytes_per_s: float = 50e9  # host <-> device, one direction, achieved


@dataclass(frozen=True)
class Deployment:
    """A model served on `tp` GPUs with SGLang's memory settings and calibration knobs."""

    name: str
    model: ModelSpec
    gpu: GpuSpec
    tp: int
    mem_fraction_static: float = 0.88
    # CUDA context, NCCL and allocator slack before SGLang measures total memory
    runtime_reserved_bytes: float = 1.5 * GiB
    compute_efficiency: float = 0.6  # achieved / peak tensor FLOP/s
    bandwidth_efficiency: float = 0.8  # achieved / peak HBM bandwidth
    allreduce_efficiency: float = 0.8
    prefill_overhead_s: float = 0.003  # scheduling + launches per prefill iteration
    decode_overhead_s: float = 0.001  # per decode iteration (CUDA graphs)
    # Latency floor of one layer's kernels (norms, rotary, small GEMMs, sampling glue) that
    # the roofline misses at small batches; added to every iteration, per layer.
    layer_overhead_s: float = 30e-6
    max_total_tokens: int | None = None  # SGLang --max-total-tokens (a cap)
    # The pool times this, after the cap: a card with more or less memory left for KV, the
    # same model and speed otherwise (bench/families.py scales pools from half to double).
    pool_scale: float = 1.0
    context_limit: int | None = None  # default: the model's max_context
    notes: str = ""

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return self.model.kv_bytes_per_token_per_gpu(self.tp)

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.model.weight_bytes / self.tp

    @property
    def pool_tokens(self) -> int:
        """KV pool size, as SGLang's profile_max_num_token computes it per GPU:
        rest = free_after_weights - total * (1 - mem_fraction_static), where total is the
        free memory before loading; tokens = rest // cell_size."""
        total = self.gpu.memory_bytes - self.runtime_reserved_bytes
        free_after_weights = total - self.weight_bytes_per_gpu
        rest = free_after_weights - total * (1.0 - self.mem_fraction_static)
        tokens = int(rest // self.kv_bytes_per_token_per_gpu)
        if tokens <= 0:
            raise ValueError(f"{self.name}: the weights leave no room for a KV cache")
        if self.max_total_tokens is not None:
            tokens = min(tokens, self.max_total_tokens)
        if self.pool_scale != 1.0:
            if not self.pool_scale > 0:
                raise ValueError(f"{self.name}: pool_scale must be > 0, got {self.pool_scale}")
            tokens = max(1, int(tokens * self.pool_scale))
        return tokens

    @property
    def max_context(self) -> int:
        return self.context_limit or self.model.max_context

    def with_(self, **changes: object) -> Deployment:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class IterationCost:
    """One iteration's duration and the parts it is attributed to (they sum to seconds)."""

    seconds: float
    prefill_new: float = 0.0
    prefill_recompute: float = 0.0
    decode: float = 0.0
    host_load: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # roofline terms, for inspection


class CostModel:
    """Iteration durations of one deployment. Each GPU does 1/tp of the FLOPs and reads 1/tp
    of the weights; KV reads are per GPU (kv_bytes_per_token_per_gpu)."""

    def __init__(self, deployment: Deployment, pcie_bytes_per_s: float | None = None) -> None:
        d = deployment
        self.d = d
        m, g = d.model, d.gpu
        self.tp = d.tp
        lin_peak = g.flops_fp8 if m.weight_bytes_per_param <= 1 else g.flops_bf16
        self._lin_rate = lin_peak * d.compute_efficiency * d.tp  # FLOP/s of the whole group
        self._attn_rate = g.flops_bf16 * d.compute_efficiency * d.tp
        self._bw = g.hbm_bytes_per_s * d.bandwidth_efficiency  # per GPU
        self._kv_gpu = d.kv_bytes_per_token_per_gpu
        self._pcie = pcie_bytes_per_s or g.pcie_bytes_per_s
        self._lm_head_flops = 2.0 * m.hidden * m.vocab  # per sampled token
        self._lin_flops = 2.0 * m.params_active  # per token
        self._pair_flops = m.prefill_attn_flops_per_pair
        self._ctx_flops = m.decode_attn_flops_per_ctx_token
        self._nodes = -(-d.tp // g.gpus_per_node)
        self._per_node = min(d.tp, g.gpus_per_node)
        self._nvlink = g.nvlink_bytes_per_s * d.allreduce_efficiency
        self._ib = g.internode_bytes_per_s * d.allreduce_efficiency
        self._ar_lat = g.internode_latency_s if self._nodes > 1 else g.allreduce_latency_s
        self._dense_weights_gpu = m.weight_bytes / d.tp
        self._moe = bool(m.n_routed_experts)
        self._prefill_fixed = d.prefill_overhead_s + m.layers * d.layer_overhead_s
        self._decode_fixed = d.decode_overhead_s + m.layers * d.layer_overhead_s

    # ---- pieces --------------------------------------------------------------------

    def allreduce(self, tokens: int) -> float:
        """Two all-reduces per layer (attention out, MLP/MoE out) of tokens x hidden bf16
        activations. Inside a node a ring moves 2 (g-1)/g of the bytes per GPU over NVLink;
        across nodes the all-reduce is hierarchical (reduce-scatter in the node, all-reduce
        of each GPU's 1/g share over its own NIC, all-gather in the node)."""
        if self.tp <= 1 or tokens <= 0:
            return 0.0
        m = self.d.model
        size = tokens * m.hidden * 2
        g, n = self._per_node, self._nodes
        one = 2.0 * (g - 1) / g * size / self._nvlink + self._ar_lat
        if n > 1:
            one += 2.0 * (n - 1) / n * (size / g) / self._ib
        return 2 * m.layers * one

    @property
    def prefill_fixed(self) -> float:
        """Seconds every prefill iteration costs whatever its size (launch overheads)."""
        return self._prefill_fixed

    @property
    def prefill_linear_per_token(self) -> float:
        """Seconds of the linear layers' FLOPs per prefilled token at full efficiency: a
        floor on recomputing one token (attention and overheads only add to it)."""
        return self._lin_flops / self._lin_rate

    def host_load(self, tokens: int) -> float:
        """Reloading KV from host memory (HiCache): every GPU copies its share over its own
        PCIe link, in parallel."""
        return tokens * self._kv_gpu / self._pcie if tokens > 0 else 0.0

    def _weights_read_gpu(self, tokens: int) -> float:
        if not self._moe:
            return self._dense_weights_gpu
        return self.d.model.weight_bytes_read(tokens) / self.tp

    # ---- iterations ----------------------------------------------------------------

    def prefill(
        self,
        chunks: Sequence[tuple[int, int]],
        recompute_tokens: int = 0,
        host_tokens: int = 0,
        sampled: int | None = None,
    ) -> IterationCost:
        """A prefill (extend) iteration. chunks: per request, the positions [start, end) of
        its tokens computed now (start = tokens already cached). recompute_tokens: how many
        of them had been computed before (attribution only). sampled: requests whose
        prefill ends here and sample a token (LM head), default all."""
        tokens = 0
        pairs = 0
        kv_touched = 0
        for s, e in chunks:
            tokens += e - s
            pairs += (e * (e + 1) - s * (s + 1)) // 2  # query at p attends to p + 1 keys
            kv_touched += e  # read the cached prefix, write the new tokens
        n_sampled = len(chunks) if sampled is None else sampled
        flops_lin = self._lin_flops * tokens + self._lm_head_flops * n_sampled
        flops_attn = self._pair_flops * pairs
        compute = flops_lin / self._lin_rate + flops_attn / self._attn_rate
        memory = (self._weights_read_gpu(tokens) + self._kv_gpu * kv_touched) / self._bw
        comm = self.allreduce(tokens)
        load = self.host_load(host_tokens)
        body = max(compute, memory) + comm + self._prefill_fixed
        exposed = self.overlapped(body, load) - body
        recompute = min(max(recompute_tokens, 0), tokens)
        share = recompute / tokens if tokens else 0.0
        return IterationCost(
            seconds=body + exposed,
            prefill_new=body * (1.0 - share),
            prefill_recompute=body * share,
            host_load=exposed,
            parts={
                "compute": compute,
                "memory": memory,
                "allreduce": comm,
                "host_transfer": load,
                "host_load": exposed,
            },
        )

    def overlapped(self, body: float, load: float) -> float:
        """A forward of `body` seconds that reloads `load` seconds of KV from host. SGLang's
        HiCache copies layer by layer on its own stream and each layer's attention waits only
        for its own layer (`LayerDoneCounter.wait_until`), so with L layers of equal share the
        pipeline takes the longer stream plus one layer of the other."""
        if load <= 0:
            return body
        layers = self.d.model.layers
        return max(body + load / layers, load + body / layers)

    def decode(self, batch: int, ctx_tokens: int) -> float:
        """A decode iteration: `batch` requests each produce one token; ctx_tokens is the
        sum over them of the KV length attended (the new token included)."""
        flops_lin = (self._lin_flops + self._lm_head_flops) * batch
        compute = flops_lin / self._lin_rate + self._ctx_flops * ctx_tokens / self._attn_rate
        memory = (self._weights_read_gpu(batch) + self._kv_gpu * ctx_tokens) / self._bw
        return max(compute, memory) + self.allreduce(batch) + self._decode_fixed

    def decode_parts(self, batch: int, ctx_tokens: int) -> dict[str, float]:
        flops_lin = (self._lin_flops + self._lm_head_flops) * batch
        return {
            "compute": flops_lin / self._lin_rate + self._ctx_flops * ctx_tokens / self._attn_rate,
            "memory": (self._weights_read_gpu(batch) + self._kv_gpu * ctx_tokens) / self._bw,
            "allreduce": self.allreduce(batch),
            "overhead": self._decode_fixed,
        }
