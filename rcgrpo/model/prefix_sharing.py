"""One forward pass per shared prompt: the layout that drops repeated prefixes.

The G rollouts of a group start with the same prompt (system prompt, function
docs, first user turn): on BFCL that is ~1.8k tokens before a reply of a few
dozen. Packed as separate sequences, every forward and backward pass computes
that prompt G times. A causal decoder's hidden state at position ``t``
depends only on tokens ``0..t``, so the rows of a shared prefix are the same
in every sequence that has it: computing them once and reading them G times
gives the same hidden states and, through the gather's backward (which sums
the rows' gradients), the same gradients.

The layout (``shared_prefix_layout``) is a prefix tree over a micro-batch's
sequences: each sequence continues the earlier one it shares the longest
prefix with and forwards only its tail (a *branch*), with its own position
ids; the mask lets the tail attend to the rows of its shared prefix, wherever
in the tree they are, and to itself causally. A sequence that shares fewer
than ``MIN_SHARED_TOKENS`` with every earlier one is forwarded whole (a
*root*). On BFCL the tree has up to four levels: the system preamble every
entry shares (149 tokens with the compact docs), the function docs of entries
that use the same API classes (up to ~5.5k tokens), each group's first user
turn, and (RC-GRPO) the rollouts of one reward token up to their first
sampled token.

Nothing downstream changes: ``expand`` maps every packed token of the batch to
its row in the forwarded tokens, so the hidden states come back in the
batch's own layout (``rcgrpo.model.attention.decoder_hidden_states``), and the
losses, log-probs and their per-sequence normalisers see the batch as packed.

Attention over the tree is ``rcgrpo.model.tree_attention``: each node's queries over
a gather of the rows its path may see, one varlen call (flash-attn on CUDA,
one SDPA call per node elsewhere); ``eager`` takes the layout's [M, M] mask.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch

from rcgrpo.model.packing import PackedBatch, balance_micro_batches

__all__ = ["SharedPrefixLayout", "shared_prefix_layout", "common_prefix_length", "forwarded_tokens",
           "micro_batch_plan", "micro_batches"]

# Sharing fewer tokens than this is not worth a segment of its own (a row of
# the visibility table, a pass of the mask build): such a sequence is
# forwarded whole, as a root.
MIN_SHARED_TOKENS = 16


@dataclass(frozen=True)
class SharedPrefixLayout:
    """Which packed tokens are forwarded and how each reads its hidden state.

    Attributes:
        keep: [M] int64, the packed positions forwarded, in packed order.
        expand: [N] int64, for each packed position, its row among the M
            forwarded tokens (its own row, or the row of the same position in
            the segment that holds its shared prefix).
        segment: [M] int64, the segment of each forwarded token: one per
            forwarded sequence (a root) or sequence tail (a branch).
        visible: [K, K] int64, K segments: queries of segment q see keys of
            segment a at positions below ``visible[q, a]`` (and their own
            segment causally): the start of the branch taken at each ancestor
            on q's path, 0 for a segment off it.
        seq_root: per sequence, the root sequence its path starts in (itself
            for a root).
        seq_forwarded: per sequence, the tokens it forwards itself.
    """

    keep: torch.Tensor
    expand: torch.Tensor
    segment: torch.Tensor
    visible: torch.Tensor
    seq_root: tuple[int, ...]
    seq_forwarded: tuple[int, ...]

    @property
    def num_forwarded(self) -> int:
        return int(self.keep.numel())

    @cached_property
    def segment_rows(self) -> list[tuple[int, int]]:
        """Per segment, its forwarded rows [lo, hi) (segments are contiguous, in order)."""
        ends = torch.cumsum(torch.bincount(self.segment.cpu(), minlength=self.visible.shape[0]), 0).tolist()
        return list(zip([0] + ends[:-1], ends))

    def visibility(self, q: int, position_ids: torch.Tensor, keys_from: int = 0,
                   keys_to: int | None = None) -> torch.Tensor:
        """[rows of segment q, keys_from:keys_to] bool: which of those keys its
        queries may attend. `position_ids` are the forwarded tokens' ([M])."""
        lo, hi = self.segment_rows[q]
        pos = position_ids.to(self.segment.device)
        keys = pos[keys_from:keys_to]
        limit = self.visible[q].to(self.segment.device)[self.segment[keys_from:keys_to]]  # each key seen below this
        return (keys[None, :] < limit[None, :]) & (keys[None, :] <= pos[lo:hi, None])

    def attention_mask(self, position_ids: torch.Tensor) -> torch.Tensor:
        """[1, 1, M, M] bool: True where forwarded query i may attend key j.
        Built one segment's rows at a time: no [M, M] temporary beyond the mask."""
        m = self.num_forwarded
        mask = torch.empty(m, m, dtype=torch.bool, device=self.segment.device)
        for q, (lo, hi) in enumerate(self.segment_rows):
            mask[lo:hi] = self.visibility(q, position_ids)
        return mask[None, None]


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D tensors."""
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0, 0]) if differ.numel() else n


_OWN = torch.iinfo(torch.int64).max  # a segment sees its own keys at every position (then causally)


def shared_prefix_layout(batch: PackedBatch, min_shared_tokens: int = MIN_SHARED_TOKENS,
                         share: bool = True) -> SharedPrefixLayout:
    """The prefix tree of the module docstring.

    Each sequence, in packed order, continues the earlier sequence it shares
    the longest prefix with (token ids and position ids both equal: a shared
    row must be the same token at the same position), when that prefix is at
    least `min_shared_tokens` long; its tail (a branch) is forwarded and the
    rest read from the rows that hold that prefix. Otherwise it is forwarded
    whole (a root). A sequence contained whole in an earlier one forwards
    nothing. `share=False`: every sequence a root (the packed batch as is,
    in segments).
    """
    cu = batch.cu_seqlens.tolist()
    ids, pos = batch.input_ids.cpu(), batch.position_ids.cpu()
    expand = torch.empty(batch.num_tokens, dtype=torch.long)
    keep: list[torch.Tensor] = []
    segment: list[torch.Tensor] = []
    seg_start: list[int] = []  # per segment: position of its first token
    seg_parent: list[int] = []  # per segment: the segment it branches from, -1 for a root
    visible: list[dict[int, int]] = []  # per segment: {ancestor or itself: limit}
    seq_path_end: list[int] = []  # per sequence: the deepest segment on its path (-1: none yet)
    seq_root: list[int] = []
    seq_forwarded: list[int] = []
    forwarded = 0
    for s in range(batch.num_seqs):
        lo, hi = cu[s], cu[s + 1]
        best, shared = -1, 0
        for r in range(s if share else 0):
            n = min(common_prefix_length(ids[lo:hi], ids[cu[r]:cu[r + 1]]),
                    common_prefix_length(pos[lo:hi], pos[cu[r]:cu[r + 1]]))
            if n > shared:
                best, shared = r, n
        if shared < min_shared_tokens:
            best, shared = -1, 0
        parent = -1
        if best >= 0:
            expand[lo:lo + shared] = expand[cu[best]:cu[best] + shared]
            parent = seq_path_end[best]
            while seg_start[parent] > shared - 1:  # walk up to the segment holding position shared - 1
                parent = seg_parent[parent]
        tail = hi - lo - shared
        if tail:
            seg = len(seg_start)
            seg_start.append(shared)
            seg_parent.append(parent)
            # Each ancestor is seen up to where this path leaves it; the parent
            # up to this branch's start.
            seen = dict(visible[parent]) if parent >= 0 else {}
            if parent >= 0:
                seen[parent] = shared
            seen[seg] = _OWN
            visible.append(seen)
            keep.append(torch.arange(lo + shared, hi))
            segment.append(torch.full((tail,), seg, dtype=torch.long))
            expand[lo + shared:hi] = torch.arange(forwarded, forwarded + tail)
            forwarded += tail
            seq_path_end.append(seg)
        else:
            seq_path_end.append(parent)
        seq_root.append(s if best < 0 else seq_root[best])
        seq_forwarded.append(tail)
    table = torch.zeros(len(visible), len(visible), dtype=torch.long)
    for q, seen in enumerate(visible):
        for a, limit in seen.items():
            table[q, a] = limit
    device = batch.input_ids.device
    return SharedPrefixLayout(
        keep=torch.cat(keep).to(device), expand=expand.to(device), segment=torch.cat(segment).to(device),
        visible=table, seq_root=tuple(seq_root), seq_forwarded=tuple(seq_forwarded),
    )


def forwarded_tokens(batch: PackedBatch, share_prefixes: bool) -> int:
    """Tokens the decoder computes for `batch` (what
    ``rcgrpo.model.attention.decoder_hidden_states`` forwards)."""
    if not share_prefixes or batch.num_seqs == 1:
        return batch.num_tokens
    return shared_prefix_layout(batch).num_forwarded


def micro_batch_plan(batch: PackedBatch, micro_batch_tokens: int, share_prefixes: bool,
                     min_bins: int = 1) -> list[list[int]]:
    """Sequence indices of each micro-batch (ascending), planned on the
    tokens each forward pass computes.

    Without sharing: ``balance_micro_batches`` on the sequence lengths.

    With it: sort, cut the prefix tree into subtrees that fit, pack them.

    1. Sort. Each prompt group's (``seq_group``; an RCTP or steer batch is
       one group) sequences in trie order (sorted by token ids), the groups
       in the order of their first sequence. Sorted, sequences that share a
       prefix are neighbours, the longer the share the nearer: a group's
       reward-token branches, then the groups (or RCTP records) of one
       entry, then the entries with the same API docs, then the rest. A run
       of neighbours is costed as the layout forwards it: the first
       sequence whole, each next one less the prefix it shares with the one
       before (none below ``MIN_SHARED_TOKENS``).
    2. Cut. Starting from the whole order, a run over `micro_batch_tokens`
       is cut where its neighbours share least (between groups before
       inside one): into the subtrees of its prefix tree's top node, each cut
       again until it fits or is one sequence. So a group that fits is never
       cut, nor are groups that share docs while they fit together.
    3. Pack. Each subtree, in order, goes into the micro-batch where it adds
       the fewest tokens within the budget (the latest on a tie), else opens
       one. It adds its cost less the prefix its first sequence shares with
       the micro-batch's last, the longest it shares with any of them in
       this order: a subtree joins its siblings while they have room, then
       fills other micro-batches' room (sharing the preamble).
    4. `min_bins`: while there are fewer micro-batches, the costliest one of
       two or more sequences is cut in two where the prefix shared across
       the cut is shortest (between groups before inside one; the more even
       cut on a tie).

    Micro-batches are filled, not balanced: balancing moves groups away
    from the ones they share with, which forwards their docs again.
    """
    if not share_prefixes:
        return balance_micro_batches(batch.seq_lens, micro_batch_tokens, min_bins)
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    if batch.num_seqs == 0:
        return []
    cu = batch.cu_seqlens.tolist()
    ids, pos = batch.input_ids.cpu(), batch.position_ids.cpu()
    tokens = [ids[cu[s]:cu[s + 1]].tolist() for s in range(batch.num_seqs)]
    groups: dict[int, list[int]] = {}
    for s, g in enumerate(batch.seq_group.tolist()):
        groups.setdefault(g, []).append(s)
    runs = sorted((sorted(m, key=lambda s: (tokens[s], s)) for m in groups.values()),
                  key=lambda m: (tokens[m[0]], m[0]))
    order = [s for m in runs for s in m]
    group_starts = set(itertools.accumulate([len(m) for m in runs[:-1]], initial=0))

    def shared(a: int, b: int) -> int:  # rows sequence b can read from sequence a
        n = min(common_prefix_length(ids[cu[a]:cu[a + 1]], ids[cu[b]:cu[b + 1]]),
                common_prefix_length(pos[cu[a]:cu[a + 1]], pos[cu[b]:cu[b + 1]]))
        return n if n >= MIN_SHARED_TOKENS else 0

    def coster(seqs: list[int]):
        """Shares of neighbours in `seqs` and the cost of any run seqs[lo:hi]."""
        share = [0] + [shared(a, b) for a, b in zip(seqs, seqs[1:])]
        below = list(itertools.accumulate((cu[s + 1] - cu[s] - c for s, c in zip(seqs, share)), initial=0))
        return share, lambda lo, hi: cu[seqs[lo] + 1] - cu[seqs[lo]] + below[hi] - below[lo + 1]

    share, cost = coster(order)
    subtrees, todo = [], [(0, len(order))]
    while todo:
        lo, hi = todo.pop()
        if hi - lo == 1 or cost(lo, hi) <= micro_batch_tokens:
            subtrees.append((lo, hi))
            continue
        least = min((i not in group_starts, share[i]) for i in range(lo + 1, hi))
        cuts = [i for i in range(lo + 1, hi) if (i not in group_starts, share[i]) == least]
        bounds = [lo] + cuts + [hi]
        todo.extend(reversed(list(zip(bounds, bounds[1:]))))  # popped in order

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
    firsts = {order[i] for i in group_starts}
    while len(bins) < min_bins:
        splittable = [k for k in range(len(bins)) if len(bins[k]) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda k: (loads[k], -k))
        b = bins[k]
        cut_share, cut_cost = coster(b)
        cut = min(range(1, len(b)), key=lambda i: (b[i] not in firsts, cut_share[i],
                                                     max(cut_cost(0, i), cut_cost(i, len(b)))))
        bins[k:k + 1] = [b[:cut], b[cut:]]
        loads[k:k + 1] = [cut_cost(0, cut), cut_cost(cut, len(b))]
    return [sorted(b) for b in bins]


def micro_batches(batch: PackedBatch, micro_batch_tokens: int, share_prefixes: bool) -> list[PackedBatch]:
    """`batch` cut into the micro-batches of ``micro_batch_plan``."""
    return [batch.select(ix) for ix in micro_batch_plan(batch, micro_batch_tokens, share_prefixes)]
