"""Micro-batches: the one place a packed batch is cut into the micro-batches
its forward passes take (training's updates, the parity oracle, the steer).

A micro-batch holds whole sequences (attention needs a sequence whole) and
at most ``micro_batch_tokens`` of the tokens its forward computes: the
packed tokens (``balance_micro_batches``, longest first into the lightest
bin), or with prefix sharing the tokens the shared layout forwards
(``shared_plan``: a group's prompt counts once per micro-batch).
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

from rcgrpo.model.packing import PackedBatch
from rcgrpo.model.prefix_sharing import MIN_SHARED_TOKENS, shared_rows, with_prefix_layout
from rcgrpo_kernels.packing import loss_token_counts

__all__ = ["balance_micro_batches", "micro_batch", "micro_batch_plan", "micro_batches", "shared_plan"]


def micro_batch_plan(batch: PackedBatch, micro_batch_tokens: int, share_prefixes: bool,
                     min_bins: int = 1, *, loss_only: bool = False) -> list[list[int]]:
    """Sequence indices of each micro-batch (ascending), planned on the
    tokens each forward pass computes: ``balance_micro_batches`` on the
    sequence lengths without prefix sharing, ``shared_plan`` with it.

    `loss_only` leaves out the micro-batches without a loss token (e.g.
    every rollout's prompt was too long): their forward would carry no loss.
    """
    if share_prefixes:
        plan = shared_plan(batch, micro_batch_tokens, min_bins)
    else:
        plan = balance_micro_batches(batch.seq_lens, micro_batch_tokens, min_bins)
    if loss_only:
        per_seq = loss_token_counts(batch.loss_mask.cpu().bool(), batch.cu_seqlens.cpu()).tolist()
        plan = [ix for ix in plan if any(per_seq[s] for s in ix)]
    return plan


def micro_batches(batch: PackedBatch, micro_batch_tokens: int, share_prefixes: bool, *,
                  loss_only: bool = False) -> list[PackedBatch]:
    """`batch` cut into the micro-batches of ``micro_batch_plan``."""
    return [micro_batch(batch, ix, share_prefixes)
            for ix in micro_batch_plan(batch, micro_batch_tokens, share_prefixes, loss_only=loss_only)]


def micro_batch(batch: PackedBatch, seq_indices: Sequence[int], share_prefixes: bool) -> PackedBatch:
    """The micro-batch of these sequences; with sharing it carries its
    prefix layout, built here once for every pass over it (the token counts,
    the forward, the reference's, the parity check)."""
    micro = batch.select(seq_indices)
    return with_prefix_layout(micro) if share_prefixes else micro


def shared_plan(batch: PackedBatch, micro_batch_tokens: int, min_bins: int = 1) -> list[list[int]]:
    """The micro-batches of a batch forwarded with shared prefixes
    (``rcgrpo.model.prefix_sharing``): sort, cut the prefix tree into
    subtrees that fit, pack them, then cut up to `min_bins` micro-batches
    (each step's rule on its helper: ``_trie_order``, ``_cut_subtrees``,
    ``_pack_subtrees``, ``_split_to_min_bins``).

    Micro-batches are filled, not balanced: balancing moves groups away
    from the ones they share with, which forwards their docs again.
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    if batch.num_seqs == 0:
        return []
    costs = _ForwardCosts(batch)
    order, group_starts = _trie_order(batch, costs)
    share, cost = costs.coster(order)
    subtrees = _cut_subtrees(len(order), group_starts, share, cost, micro_batch_tokens)
    bins, loads = _pack_subtrees(subtrees, order, cost, costs.shared, micro_batch_tokens)
    firsts = {order[i] for i in group_starts}
    _split_to_min_bins(bins, loads, firsts, costs, min_bins)
    return [sorted(b) for b in bins]


class _ForwardCosts:
    """What the shared layout forwards for runs of a batch's sequences: the
    prefix two sequences share and the cost of a run of neighbours."""

    def __init__(self, batch: PackedBatch):
        self.cu = batch.cu_seqlens.tolist()
        self.ids, self.pos = batch.input_ids.cpu(), batch.position_ids.cpu()

    def tokens(self, s: int) -> list[int]:
        """Sequence s's token ids."""
        return self.ids[self.cu[s]:self.cu[s + 1]].tolist()

    def shared(self, a: int, b: int) -> int:
        """Rows sequence b can read from sequence a (none below ``MIN_SHARED_TOKENS``)."""
        n = shared_rows(self.cu, self.ids, self.pos, a, b)
        return n if n >= MIN_SHARED_TOKENS else 0

    def coster(self, seqs: list[int]) -> tuple[list[int], Callable[[int, int], int]]:
        """Shares of neighbours in `seqs` and the cost of any run seqs[lo:hi]:
        the first sequence whole, each next one less the prefix it shares
        with the one before."""
        cu = self.cu
        share = [0] + [self.shared(a, b) for a, b in zip(seqs, seqs[1:])]
        below = list(itertools.accumulate((cu[s + 1] - cu[s] - c for s, c in zip(seqs, share)), initial=0))
        return share, lambda lo, hi: cu[seqs[lo] + 1] - cu[seqs[lo]] + below[hi] - below[lo + 1]


def _trie_order(batch: PackedBatch, costs: _ForwardCosts) -> tuple[list[int], set[int]]:
    """Step 1, sort: the sequences in trie order, and the positions in that
    order where a prompt group starts.

    Each prompt group's (``seq_group``; an RCTP or steer batch is one group)
    sequences in trie order (sorted by token ids), the groups in the order of
    their first sequence. Sorted, sequences that share a prefix are
    neighbours, the longer the share the nearer: a group's reward-token
    branches, then the groups (or RCTP records) of one entry, then the
    entries with the same API docs, then the rest. A run of neighbours is
    costed as the layout forwards it (``_ForwardCosts.coster``).
    """
    tokens = [costs.tokens(s) for s in range(batch.num_seqs)]
    groups: dict[int, list[int]] = {}
    for s, g in enumerate(batch.seq_group.tolist()):
        groups.setdefault(g, []).append(s)
    runs = sorted((sorted(m, key=lambda s: (tokens[s], s)) for m in groups.values()),
                  key=lambda m: (tokens[m[0]], m[0]))
    order = [s for m in runs for s in m]
    group_starts = set(itertools.accumulate([len(m) for m in runs[:-1]], initial=0))
    return order, group_starts


def _cut_subtrees(n: int, group_starts: set[int], share: list[int], cost: Callable[[int, int], int],
                  micro_batch_tokens: int) -> list[tuple[int, int]]:
    """Step 2, cut: the order's runs [lo, hi) that each fit (or are one sequence), in order.

    Starting from the whole order, a run over `micro_batch_tokens` is cut
    where its neighbours share least (between groups before inside one):
    into the subtrees of its prefix tree's top node, each cut again until it
    fits or is one sequence. So a group that fits is never cut, nor are
    groups that share docs while they fit together.
    """
    subtrees, todo = [], [(0, n)]
    while todo:
        lo, hi = todo.pop()
        if hi - lo == 1 or cost(lo, hi) <= micro_batch_tokens:
            subtrees.append((lo, hi))
            continue
        least = min((i not in group_starts, share[i]) for i in range(lo + 1, hi))
        cuts = [i for i in range(lo + 1, hi) if (i not in group_starts, share[i]) == least]
        bounds = [lo] + cuts + [hi]
        todo.extend(reversed(list(zip(bounds, bounds[1:]))))  # popped in order
    return subtrees


def _pack_subtrees(subtrees: list[tuple[int, int]], order: list[int], cost: Callable[[int, int], int],
                   shared: Callable[[int, int], int], micro_batch_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Step 3, pack: the micro-batches (sequences in order) and the tokens each forwards.

    Each subtree, in order, goes into the micro-batch where it adds the
    fewest tokens within the budget (the latest on a tie), else opens one.
    It adds its cost less the prefix its first sequence shares with the
    micro-batch's last, the longest it shares with any of them in this
    order: a subtree joins its siblings while they have room, then fills
    other micro-batches' room (sharing the preamble).
    """
    bins: list[list[int]] = []
    loads: list[int] = []
    for lo, hi in subtrees:
        adds = [cost(lo, hi) - shared(b[-1], order[lo]) for b in bins]
        fits = [k for k in range(len(bins)) if loads[k] + adds[k] <= micro_batch_tokens]
        if fits:
            k = min(reversed(fits), key=lambda k: adds[k])
            bins[k] += order[lo:hi]
            loads[k] += adds[k]
        else:
            bins.append(order[lo:hi])
            loads.append(cost(lo, hi))
    return bins, loads


def _split_to_min_bins(bins: list[list[int]], loads: list[int], firsts: set[int],
                       costs: _ForwardCosts, min_bins: int) -> None:
    """Step 4, `min_bins` (in place): while there are fewer micro-batches,
    the costliest one of two or more sequences is cut in two where the
    prefix shared across the cut is shortest (between groups before inside
    one: `firsts` are the sequences that start a group; the more even cut on
    a tie)."""
    while len(bins) < min_bins:
        splittable = [k for k in range(len(bins)) if len(bins[k]) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda k: (loads[k], -k))
        b = bins[k]
        cut_share, cut_cost = costs.coster(b)
        cut = min(range(1, len(b)), key=lambda i: (b[i] not in firsts, cut_share[i],
                                                     max(cut_cost(0, i), cut_cost(i, len(b)))))
        bins[k:k + 1] = [b[:cut], b[cut:]]
        loads[k:k + 1] = [cut_cost(0, cut), cut_cost(cut, len(b))]


def balance_micro_batches(lengths: Sequence[int], micro_batch_tokens: int, min_bins: int = 1) -> list[list[int]]:
    """Split sequences into micro-batches of balanced token count.

    Greedy longest-first (LPT): start with ``max(min_bins, ceil(total /
    micro_batch_tokens))`` bins, put each sequence, longest first, into the
    currently lightest bin; if it would overflow ``micro_batch_tokens`` there,
    open a new bin for it. A sequence longer than ``micro_batch_tokens`` gets
    a bin of its own (it cannot be split: attention needs the whole sequence).

    Returns:
        Non-empty lists of sequence indices; each list is in ascending index
        order and every index appears exactly once.
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    if not lengths:
        return []
    total = sum(lengths)
    k = min(len(lengths), max(min_bins, -(-total // micro_batch_tokens)))
    loads = [0] * k
    bins: list[list[int]] = [[] for _ in range(k)]
    # Longest first: the big items fix the shape, the small ones fill the gaps.
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(len(bins)), key=lambda j: (loads[j], j))
        if loads[b] > 0 and loads[b] + lengths[i] > micro_batch_tokens:
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins if b]
