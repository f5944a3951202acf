"""Balancing variable-length sequences across bins (data-parallel ranks, micro-batches).

Cost model: one sequence of L tokens costs ``L + q * L**2`` relative units: the linear layers are
linear in L, causal attention adds the quadratic term (``attention_quadratic`` derives q).

``partition`` is the Karmarkar-Karp largest differencing method generalised to k bins. A *state* is
k bins (sum, indices) that will stay together; every item starts as a state of its own. The two
states with the largest spread (max bin - min bin) are merged by pairing the largest bin of one with
the smallest bin of the other, the second largest with the second smallest, and so on: the spreads
largely cancel, so committing the biggest differences first leaves the small items to even out the
rest. Merging until one state is left gives the partition. With ``equal_count`` the initial states
are chunks of k consecutive items (weight order), one item per bin; since every merge combines
exactly one bin of each state, all bins keep the same count.

A deterministic local search then refines the KK lists: each round takes the list with the largest
sum and applies the best single move (one item to another list; with ``equal_count`` only from a
longer to a shorter list, so lengths stay within 1) or swap (one item each way) with any other list,
the one leaving the smaller max of the pair's two sums. For each item x of the largest list A and
each other list B, the best partner y is the one with x - y nearest (sum_A - sum_B) / 2: found by
bisection in B's sorted weights, so a round costs O(n log n). It stops when no move or swap lowers
that max by more than float noise (1e-9 of it), or after 4 * len(weights) rounds.

``micro_batch_bins`` searches the smallest bin count whose partition fits a token budget.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Sequence

_Bin = tuple[float, list[int]]  # (sum of weights, indices; dummy padding indices are >= len(weights))


def sequence_cost(length: int, quadratic: float) -> float:
    """Relative compute of one sequence of ``length`` tokens: ``length + quadratic * length**2``
    (the linear layers, plus causal attention's s^2 term)."""
    return length + quadratic * length * length


def attention_quadratic(hidden_size: int, params_per_layer: int) -> float:
    """The ``quadratic`` coefficient of ``sequence_cost`` for a transformer: ``hidden_size / params_per_layer``.

    Per layer, the linear layers cost 2 * P FLOPs per token (P = the layer's parameters), so 2 P L
    for a sequence of L tokens; causal attention (QK^T and AV, each 2 h FLOPs per query-key pair, half
    of the L^2 pairs kept by the mask) costs 2 * 2 * h * L^2 / 2 = 2 h L^2. Dividing the sum by 2 P
    gives L + (h / P) L^2.
    """
    if hidden_size < 0 or params_per_layer <= 0:
        raise ValueError(f"need hidden_size >= 0 and params_per_layer > 0, got {hidden_size}, {params_per_layer}")
    return hidden_size / params_per_layer


def _sorted_desc(bins: list[_Bin]) -> list[_Bin]:
    # Stable sort: equal sums keep their (deterministic) merge order, never an order from hashes or ids.
    return sorted(bins, key=lambda b: -b[0])


def _merge(a: list[_Bin], b: list[_Bin]) -> list[_Bin]:
    """Combine two states (bins sorted by sum descending): a's i-th largest bin with b's i-th smallest."""
    return _sorted_desc([(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))])


def _refine(weights: Sequence[float], lists: list[list[int]], equal_count: bool) -> list[list[int]]:
    """The local search above on KK's ``lists`` (real indices only). Ties between equally good moves go
    to the first list, then the lighter item of A, then the lighter partner (a move before a swap with a
    zero), then the lowest indices, so the choice depends only on the weights and the KK result."""
    k = len(lists)
    items = [sorted((weights[i], i) for i in lst) for lst in lists]  # ascending (weight, index)
    ws = [[w for w, _ in its] for its in items]
    sums = [math.fsum(w) for w in ws]
    for _ in range(4 * len(weights)):
        a = max(range(k), key=lambda j: (sums[j], -j))  # the largest sum; the first such list on ties
        sa, wa = sums[a], ws[a]
        # (-gain, list b, weight from A, weight from B or -1 for a move); the gain lowers max(sum_A, sum_B)
        # = sum_A. It must beat float noise: an x - y within rounding of 0 or of the gap would only cycle.
        best = (-sa * 1e-9, -1, 0.0, 0.0)
        for b in sorted(range(k), key=lambda j: sums[j]):  # the lightest first: the largest possible gains
            wb = ws[b]
            gap = sa - sums[b]  # moving d = x - y gains min(d, gap - d): at most gap / 2
            if gap <= 0 or -gap / 2 > best[0]:  # b == a, or no later list can match the best gain
                break
            if wa and (not equal_count or len(wa) > len(wb)):  # moves: x nearest gap / 2
                p = bisect_left(wa, gap / 2)
                for x in wa[max(p - 1, 0) : p + 1]:
                    key = (-min(x, gap - x), b, x, -1.0)
                    if key < best:
                        best = key
            if not wb:
                continue
            prev = None
            for x in wa:
                if x == prev:
                    continue
                prev = x
                p = bisect_left(wb, x - gap / 2)
                for y in wb[max(p - 1, 0) : p + 1]:
                    gain = min(x - y, gap - x + y)
                    if -gain <= best[0] and (-gain, b, x, y) < best:
                        best = (-gain, b, x, y)
        _, b, x, y = best
        if b < 0:  # nothing lowers the max of A and any other list
            break
        # The lowest index among items of the chosen weight: items sort by (weight, index).
        pos = bisect_left(wa, x)
        xa = items[a].pop(pos)
        del wa[pos]
        if y >= 0:
            pos = bisect_left(ws[b], y)
            yb = items[b].pop(pos)
            del ws[b][pos]
            insort(items[a], yb)
            insort(wa, y)
        insort(items[b], xa)
        insort(ws[b], x)
        sums[a], sums[b] = math.fsum(wa), math.fsum(ws[b])
    return [[i for _, i in its] for its in items]


def partition(weights: Sequence[float], k: int, *, equal_count: bool = False) -> list[list[int]]:
    """Karmarkar-Karp (largest differencing) k-way partition of the indices of ``weights``.

    Heuristically minimises the largest list sum (KK, then the local search of the module docstring).
    Returns k lists of indices, each sorted ascending; the lists are ordered by their sum descending,
    then by smallest index (empty lists last).
    Deterministic: identical inputs give identical outputs on every process (ties are broken by index).
    ``equal_count=True``: list lengths differ by at most 1 (the items are padded internally with
    zero-weight dummies up to a multiple of k, which are dropped from the result).
    ``k`` may exceed ``len(weights)`` (some lists are then empty); empty weights give k empty lists.
    Raises ValueError for k < 1 or a weight that is negative or NaN.
    """
    if k < 1:
        raise ValueError(f"partition needs k >= 1, got {k}")
    n = len(weights)
    for i, w in enumerate(weights):
        if not w >= 0:  # also catches NaN
            raise ValueError(f"partition needs weights >= 0, weights[{i}] = {w}")
    items = list(weights)
    if equal_count:
        items += [0.0] * (-n % k)
    # Heaviest first, ties by index: fixes both the equal_count chunks and the heap's tie order.
    order = sorted(range(len(items)), key=lambda i: (-items[i], i))
    if equal_count:
        states = [[(items[i], [i]) for i in order[c : c + k]] for c in range(0, len(order), k)]  # already descending
    else:
        states = [[(items[i], [i])] + [(0.0, []) for _ in range(k - 1)] for i in order]
    # Max-heap on spread; the creation counter breaks ties (and keeps the states themselves uncompared).
    heap = [(-(s[0][0] - s[-1][0]), seq, s) for seq, s in enumerate(states)]
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        merged = _merge(a, b)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), seq, merged))
        seq += 1
    final = heap[0][2] if heap else [(0.0, []) for _ in range(k)]
    lists = _refine(weights, [[i for i in idx if i < n] for _, idx in final], equal_count)
    lists = [sorted(lst) for lst in lists]
    # fsum of the sorted list: the exact rounded sum, whatever order the merges added it in.
    return sorted(lists, key=lambda lst: (-math.fsum(weights[i] for i in lst), lst[0] if lst else n))


def micro_batch_bins(
    lengths: Sequence[int], budget: int, *, min_bins: int = 1, multiple_of: int = 1
) -> list[list[int]]:
    """Indices of ``lengths`` (token counts of sequences) grouped into micro-batches of at most ``budget`` tokens.

    The count is the smallest k >= max(min_bins, ceil(sum / budget)), k a multiple of ``multiple_of``,
    for which ``partition(lengths, k)`` keeps every list sum <= budget (k, then the next multiple, ...:
    it terminates, since with k >= len(lengths) every sample gets its own list). Empty lists are kept
    (the caller pads them), so exactly k lists come back; empty ``lengths`` give
    max(min_bins, 0) rounded up to ``multiple_of`` empty lists. Raises ValueError for budget < 1,
    min_bins < 0, multiple_of < 1, or a sample longer than the budget.
    """
    if budget < 1:
        raise ValueError(f"train.max_tokens_per_microbatch must be >= 1, got {budget}")
    if min_bins < 0 or multiple_of < 1:
        raise ValueError(f"need min_bins >= 0 and multiple_of >= 1, got {min_bins}, {multiple_of}")
    longest = max(lengths, default=0)
    if longest > budget:
        raise ValueError(f"a sample of {longest} tokens exceeds train.max_tokens_per_microbatch={budget}")
    # At least one bin to hold any samples (all of length 0 would otherwise give ceil(0) = 0 bins).
    k = max(min_bins, -(-sum(lengths) // budget), 1 if lengths else 0)  # integer ceil: exact for any total
    k = -(-k // multiple_of) * multiple_of
    if k == 0:
        return []
    while True:
        bins = partition(lengths, k)
        if sum(lengths[i] for i in bins[0]) <= budget:  # bins[0] has the largest sum
            return bins
        k += multiple_of


def imbalance(sums: Sequence[float]) -> float:
    """max / mean of ``sums`` (1.0 is perfect balance); 1.0 for an empty or all-zero input."""
    total = math.fsum(sums)
    if total == 0:
        return 1.0
    return max(sums) / (total / len(sums))
