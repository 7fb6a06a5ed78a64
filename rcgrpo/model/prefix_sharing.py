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

Micro-batches are planned on the tokens this layout forwards
(``rcgrpo.model.micro_batching.shared_plan``).

Attention over the tree is ``rcgrpo.model.tree_attention``: each node's queries over
a gather of the rows its path may see, one varlen call (flash-attn on CUDA,
one SDPA call per node elsewhere); ``eager`` takes the layout's [M, M] mask.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from rcgrpo.model.packing import PackedBatch

__all__ = ["SharedPrefixLayout", "shared_prefix_layout", "prefix_layout", "with_prefix_layout", "common_prefix_length",
           "shared_rows", "forwarded_tokens"]

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


def shared_rows(cu: list[int], ids: torch.Tensor, pos: torch.Tensor, a: int, b: int) -> int:
    """The prefix packed sequences a and b share (`cu`: the batch's
    cu_seqlens; `ids`, `pos`: its token and position ids): a shared row must
    be the same token at the same position."""
    return min(common_prefix_length(ids[cu[a]:cu[a + 1]], ids[cu[b]:cu[b + 1]]),
               common_prefix_length(pos[cu[a]:cu[a + 1]], pos[cu[b]:cu[b + 1]]))


_OWN = torch.iinfo(torch.int64).max  # a segment sees its own keys at every position (then causally)


def shared_prefix_layout(batch: PackedBatch, min_shared_tokens: int = MIN_SHARED_TOKENS,
                         share: bool = True) -> SharedPrefixLayout:
    """The prefix tree of the module docstring.

    Each sequence, in packed order, continues the earlier sequence it shares
    the longest prefix with (``_longest_shared_prefix``), when that prefix is
    at least `min_shared_tokens` long; its tail (a branch) is forwarded and
    the rest read from the rows that hold that prefix. Otherwise it is
    forwarded whole (a root). A sequence contained whole in an earlier one
    forwards nothing. `share=False`: every sequence a root (the packed batch
    as is, in segments).
    """
    cu = batch.cu_seqlens.tolist()
    ids, pos = batch.input_ids.cpu(), batch.position_ids.cpu()
    tree = _PrefixTree(cu, batch.num_tokens)
    for s in range(batch.num_seqs):
        best, shared = _longest_shared_prefix(s, cu, ids, pos, s if share else 0)
        if shared < min_shared_tokens:
            best, shared = -1, 0
        tree.add(s, best, shared)
    return tree.layout(batch.input_ids.device)


def _longest_shared_prefix(s: int, cu: list[int], ids: torch.Tensor, pos: torch.Tensor,
                           candidates: int) -> tuple[int, int]:
    """(r, n): the first of sequences 0..candidates-1 with the longest prefix
    shared with sequence s, and its length; (-1, 0) if none. Token ids and
    position ids both equal: a shared row must be the same token at the
    same position."""
    best, shared = -1, 0
    for r in range(candidates):
        n = shared_rows(cu, ids, pos, s, r)
        if n > shared:
            best, shared = r, n
    return best, shared


class _PrefixTree:
    """The layout's tree as it is built, one sequence at a time, in packed order."""

    def __init__(self, cu: list[int], num_tokens: int):
        self.cu = cu
        self.expand = torch.empty(num_tokens, dtype=torch.long)
        self.keep: list[torch.Tensor] = []
        self.segment: list[torch.Tensor] = []
        self.seg_start: list[int] = []  # per segment: position of its first token
        self.seg_parent: list[int] = []  # per segment: the segment it branches from, -1 for a root
        self.visible: list[dict[int, int]] = []  # per segment: {ancestor or itself: limit}
        self.seq_path_end: list[int] = []  # per sequence: the deepest segment on its path (-1: none yet)
        self.seq_root: list[int] = []
        self.seq_forwarded: list[int] = []
        self.forwarded = 0

    def add(self, s: int, best: int, shared: int) -> None:
        """Sequence s, continuing sequence `best` for `shared` tokens (-1, 0: a root)."""
        lo, hi = self.cu[s], self.cu[s + 1]
        parent = -1
        if best >= 0:
            self.expand[lo:lo + shared] = self.expand[self.cu[best]:self.cu[best] + shared]
            parent = self.seq_path_end[best]
            while self.seg_start[parent] > shared - 1:  # walk up to the segment holding position shared - 1
                parent = self.seg_parent[parent]
        tail = hi - lo - shared
        if tail:
            self.seq_path_end.append(self._add_segment(lo, hi, shared, parent))
        else:
            self.seq_path_end.append(parent)
        self.seq_root.append(s if best < 0 else self.seq_root[best])
        self.seq_forwarded.append(tail)

    def _add_segment(self, lo: int, hi: int, shared: int, parent: int) -> int:
        """A segment for packed positions [lo + shared, hi), branching from `parent`; its index."""
        tail = hi - lo - shared
        seg = len(self.seg_start)
        self.seg_start.append(shared)
        self.seg_parent.append(parent)
        # Each ancestor is seen up to where this path leaves it; the parent
        # up to this branch's start.
        seen = dict(self.visible[parent]) if parent >= 0 else {}
        if parent >= 0:
            seen[parent] = shared
        seen[seg] = _OWN
        self.visible.append(seen)
        self.keep.append(torch.arange(lo + shared, hi))
        self.segment.append(torch.full((tail,), seg, dtype=torch.long))
        self.expand[lo + shared:hi] = torch.arange(self.forwarded, self.forwarded + tail)
        self.forwarded += tail
        return seg

    def layout(self, device: torch.device) -> SharedPrefixLayout:
        """The finished tree, its tensors on `device` (the visibility table stays on the CPU)."""
        table = torch.zeros(len(self.visible), len(self.visible), dtype=torch.long)
        for q, seen in enumerate(self.visible):
            for a, limit in seen.items():
                table[q, a] = limit
        return SharedPrefixLayout(
            keep=torch.cat(self.keep).to(device), expand=self.expand.to(device),
            segment=torch.cat(self.segment).to(device), visible=table,
            seq_root=tuple(self.seq_root), seq_forwarded=tuple(self.seq_forwarded),
        )


def prefix_layout(batch: PackedBatch) -> SharedPrefixLayout:
    """`batch`'s shared-prefix layout: the one it carries (a micro-batch's,
    built once), else built now."""
    return batch.prefix_layout if batch.prefix_layout is not None else shared_prefix_layout(batch)


def with_prefix_layout(batch: PackedBatch) -> PackedBatch:
    """`batch` carrying its shared-prefix layout (one sequence needs none)."""
    return batch if batch.num_seqs < 2 else dataclasses.replace(batch, prefix_layout=shared_prefix_layout(batch))


def forwarded_tokens(batch: PackedBatch, share_prefixes: bool) -> int:
    """Tokens the decoder computes for `batch` (what
    ``rcgrpo.model.attention.decoder_hidden_states`` forwards)."""
    if not share_prefixes or batch.num_seqs == 1:
        return batch.num_tokens
    return prefix_layout(batch).num_forwarded
