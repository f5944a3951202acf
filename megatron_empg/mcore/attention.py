"""Core attentions for Megatron's local layer spec (``mcore.attention_backends``: ``sdpa``, ``unfused``).

Megatron's ``SelfAttention`` calls its core attention after the QKV projection and RoPE:

    padded rows   query [s, b, heads, dim], key / value [s, b, groups, dim] -> [s, b, heads * dim]
    packed rows   (``packed_seq_params`` THD, b squeezed) query [t, heads, dim], key / value
                  [t, groups, dim] -> [t, heads * dim]; attention never crosses ``cu_seqlens``

Heads and groups are this tensor-parallel rank's. Both attentions here are causal self-attention
(the only kind the GPT models of this project use): on padded rows the padding follows each
sequence's real tokens, so the causal mask alone keeps real queries off it.

``SdpaAttention``   ``scaled_dot_product_attention`` on padded rows; on packed rows
                    ``varlen_attn`` on CUDA where this torch has it, else SDPA per length bucket of
                    the row (``mcore.thd``). Keeps q, k, v, the output and its logsumexp for
                    backward, never the [heads, s, s] scores. Under context parallelism
                    (``context_parallel_size`` > 1) packed rows only, split over the CP group:
                    ``mcore.cp_attention``.
``UnfusedAttention`` Megatron's ``DotProductAttention`` (the [b * heads, s, s] scores, an fp32 softmax
                    and a copy), which also takes packed rows, per length bucket: the reference.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.cp_attention import context_parallel_attention
from megatron_empg.mcore.thd import ThdLayout

cpu_shims.install_pre_import()

from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.utils import divide  # noqa: E402

log = logging.getLogger(__name__)


def _thd_layout(packed_seq_params) -> ThdLayout:
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"packed sequences in qkv_format {packed_seq_params.qkv_format!r}: expected 'thd'")
    if not isinstance(packed_seq_params, ThdLayout):
        raise TypeError("packed rows of the local spec come as mcore.thd.ThdLayout (mcore.thd.thd_layout(batch))")
    return packed_seq_params


def _check_causal(attn_mask_type: AttnMaskType, attention_bias) -> None:
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"the local core attentions are causal self-attention; got {attn_mask_type}")
    if attention_bias is not None:
        raise ValueError("an attention bias is not supported by the local core attentions")


class UnfusedAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention``, which also takes packed rows (one call per length
    bucket of ``ThdLayout.buckets``, under the causal mask)."""

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        _check_causal(attn_mask_type or self.attn_mask_type, attention_bias)
        layout = _thd_layout(packed_seq_params)
        out = query.new_empty(query.size(0), query.size(1) * query.size(2))
        for bucket in layout.buckets():
            mask = torch.ones(bucket.longest, bucket.longest, dtype=torch.bool, device=query.device).triu_(1)
            q, k, v = (bucket.unpack(x).transpose(0, 1) for x in (query, key, value))  # [L, n, heads, dim]
            context = super().forward(q, k, v, mask[None, None], attn_mask_type, attention_bias)  # [L, n, h * d]
            bucket.pack_(out, context.transpose(0, 1))
        return out  # [t, heads * dim], as TE's THD attention returns


class SdpaAttention(MegatronModule):
    """Causal core attention on torch's fused kernels (module docstring). The constructor takes
    ``DotProductAttention``'s arguments; ``attention_mask`` is not read (padded rows are causal,
    see the module docstring), so that no mask is built or copied per layer."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        unsupported = {
            "attention_dropout": (config.attention_dropout if attention_dropout is None else attention_dropout) != 0,
            "softmax_type": config.softmax_type != "vanilla",
            "window_size": config.window_size is not None,
        }
        if any(unsupported.values()):
            raise ValueError(f"SdpaAttention does not support {[k for k, v in unsupported.items() if v]}")
        _check_causal(attn_mask_type, None)
        self.attn_mask_type = attn_mask_type
        cp = config.context_parallel_size
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            required = ["tp", "cp"] if cp > 1 else ["tp"]
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=required)
        # Megatron's cp_comm_type (p2p, a2a, ...) names TE's schemes; this attention all-gathers K / V.
        self.cp_group = pg_collection.cp if cp > 1 else None
        if self.cp_group is not None and self.cp_group.size() != cp:
            raise ValueError(f"context_parallel_size={cp} but the CP process group has {self.cp_group.size()} ranks")
        tp = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the
        # scores back before the softmax: the same attention, so it does not enter here.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        _check_causal(attn_mask_type or self.attn_mask_type, attention_bias)
        # varlen_attn runs the flash kernel, which takes fp16 / bf16 only: fp32 rows go through SDPA
        varlen = varlen_attention() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
        if self.cp_group is not None:
            if packed_seq_params is None:
                raise ValueError(
                    f"SdpaAttention under context parallelism (context_parallel_size="
                    f"{self.cp_group.size()}) takes packed THD rows split over the CP ranks "
                    "(parallel.context_parallel.split_microbatch); got padded rows"
                )
            return context_parallel_attention(
                query, key, value, _thd_layout(packed_seq_params), self.cp_group, self.softmax_scale, varlen
            )
        if packed_seq_params is not None:
            layout = _thd_layout(packed_seq_params)
            if varlen is not None:
                return varlen(query, key, value, layout, self.softmax_scale)
            return self._buckets(query, key, value, layout)
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, dim]
        with _sdpa_priority(query):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=self.groups != self.heads
            )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _buckets(self, query: Tensor, key: Tensor, value: Tensor, layout: ThdLayout) -> Tensor:
        """Packed rows without ``varlen_attn``: SDPA on each length bucket as a right-padded batch."""
        out = query.new_empty(query.size(0), query.size(1) * query.size(2))
        for bucket in layout.buckets():
            q, k, v = (bucket.unpack(x).transpose(1, 2) for x in (query, key, value))  # [n, heads, L, dim]
            with _sdpa_priority(query):
                context = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=self.groups != self.heads
                )
            bucket.pack_(out, context.transpose(1, 2))
        return out


def _sdpa_priority(like: Tensor):
    """On CUDA, SDPA's kernels in the order to try (cuDNN first: on Hopper it measured 1.7-2.3x the
    flash kernel for training shapes; the math kernel last, so that a shape no fused kernel
    takes still runs); on CPU torch's own choice."""
    if not like.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


# --------------------------------------------------------------------------------------------
# varlen_attn: its keyword arguments changed between torch releases (2.9: is_causal; 2.10:
# window_size and scale; 2.12: enable_gqa), so they are read from its signature.


class _Varlen:
    """``varlen_attn`` on a packed row, in whichever form this torch has."""

    def __init__(self, fn, parameters) -> None:
        self.fn = fn
        self.causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
        self.takes_scale = "scale" in parameters
        self.takes_gqa = "enable_gqa" in parameters

    def describe(self) -> str:
        return (
            f"varlen_attn({', '.join(self.causal)}{', scale' if self.takes_scale else ''}"
            f"{', enable_gqa' if self.takes_gqa else ''})"
        )

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, layout: ThdLayout, scale: float) -> Tensor:
        """[t, heads, dim], [t, groups, dim] x 2 -> [t, heads * dim]."""
        cu, longest = layout.cu_seqlens_q, layout.max_seqlen_q
        return self.segments(query, key, value, cu, cu, longest, longest, scale)

    def segments(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        scale: float,
    ) -> Tensor:
        """Query segment i ([t_q, heads, dim] at ``cu_seqlens_q``) attends causally to key / value
        segment i ([t_k, groups, dim] at ``cu_seqlens_k``, int32) -> [t_q, heads * dim]. Where a
        key segment is longer, the causal mask is the kernel's (flash: aligned to the bottom right)."""
        kwargs = dict(self.causal)
        if self.takes_scale:
            kwargs["scale"] = scale
        elif not math.isclose(scale, 1.0 / math.sqrt(query.size(-1))):
            query = query * (scale * math.sqrt(query.size(-1)))  # the kernel's default is 1 / sqrt(dim)
        if key.size(1) != query.size(1):
            if self.takes_gqa:
                kwargs["enable_gqa"] = True
            elif not _varlen_native_gqa():
                key, value = (x.repeat_interleave(query.size(1) // x.size(1), dim=1) for x in (key, value))
        out = self.fn(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)
        return out.reshape(out.size(0), -1)


@functools.lru_cache(maxsize=1)
def varlen_attention() -> _Varlen | None:
    """This torch's ``varlen_attn`` (None where it has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return _Varlen(varlen_attn, inspect.signature(varlen_attn).parameters)


@functools.lru_cache(maxsize=1)
def _varlen_native_gqa() -> bool:
    """Whether a ``varlen_attn`` without ``enable_gqa`` takes fewer K/V heads than query heads (the
    flash kernel under it does) and gives SDPA's result: probed once on a tiny CUDA row; if not,
    K and V are expanded to the query heads."""
    varlen = varlen_attention()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(16, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = torch.tensor([0, 7, 16], device="cuda", dtype=torch.int32)
    try:
        out = varlen.fn(q, k, v, cu, cu, 9, 9, **varlen.causal)
    except (RuntimeError, ValueError):
        return False
    ref = torch.cat(
        [
            F.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
            for a, b in ((0, 7), (7, 16))
        ]
    )
    native = bool(torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=0))
    log.info("varlen_attn %s GQA natively", "takes" if native else "does not take")
    return native
