"""``mcore.thd.vectorized_thd_rope``, which replaces megatron-core's per-sequence loop
for packed (THD) rows: the same rotation, token for token, as megatron-core's own function."""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.megatron

ONE_RANK = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # a context-parallel group of one


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("whole_row_freqs", [False, True])
def test_vectorized_thd_rope_equals_megatron_loop(interleaved, whole_row_freqs):
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_empg.mcore import thd

    assert rope_utils._apply_rotary_pos_emb_thd is thd.vectorized_thd_rope  # installed
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3, 6]  # the last: a padding segment
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    total = int(cu_seqlens[-1])
    t = torch.randn(total, 4, 16, generator=g, dtype=torch.float64)
    freqs = torch.randn(total if whole_row_freqs else max(lengths) + 3, 1, 1, 12, generator=g, dtype=torch.float64)
    ours = thd.vectorized_thd_rope(t, cu_seqlens, freqs, rotary_interleaved=interleaved, cp_group=ONE_RANK)
    loop = thd._LOOPED_THD_ROPE(t, cu_seqlens, freqs, rotary_interleaved=interleaved, cp_group=ONE_RANK)
    torch.testing.assert_close(ours, loop, rtol=0, atol=0)
    # a sequence after the first is rotated from position 0 (not as a continuation)
    if not whole_row_freqs:
        first = thd.vectorized_thd_rope(
            t[5:6], torch.tensor([0, 1], dtype=torch.int32), freqs, rotary_interleaved=interleaved, cp_group=ONE_RANK
        )
        torch.testing.assert_close(ours[5:6], first, rtol=0, atol=0)
