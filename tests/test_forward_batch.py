"""ForwardBatch: which keys each new token sees (a causal chain, one non-causal block, or any matrix: many
training blocks, a tree's ancestors), and attention through it."""

import math

import torch

from blockspec.layers.attention import Attention
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.kv_cache import KVCache

TREE_PARENTS = [-1, 0, 0, 1]  # node 0 is the pending token; 1 and 2 its children; 3 a child of 1


def ancestors(parents: list[int]) -> torch.Tensor:
    """bool [1, n, n]: node i sees node j iff j is i or one of its ancestors."""
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        while parent >= 0:
            seen[i, parent] = True
            parent = parents[parent]
    return seen.unsqueeze(0)


def cache(head_dim: int = 4) -> KVCache:
    return KVCache(1, 2, 16, 1, head_dim, torch.float32, "cpu")


def test_cache_masks_exact_patterns():
    causal = ForwardBatch.in_cache(cache(), [0, 1], [2, 3], num_new=3).visible()
    assert causal[0].int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert causal[1].int().tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    block = ForwardBatch.in_cache(cache(), [0, 1], [2, 3], num_new=3, among_new="all").visible()
    assert block[0].int().tolist() == [[1, 1, 1, 1, 1, 0]] * 3 and block[1].all()
    chain = torch.ones(3, 3, dtype=torch.bool).tril().unsqueeze(0)  # a matrix that spells a chain
    assert torch.equal(ForwardBatch.in_cache(cache(), [0, 1], [2, 3], num_new=3, among_new=chain).visible(),
                       causal)
    # one row that sees every key needs no mask at all
    assert ForwardBatch.in_cache(cache(), [0], [2], num_new=3, among_new="all").visible() is None
    assert ForwardBatch.in_cache(cache(), [0], [2], num_new=1).visible() is None


def test_tree_mask_exact_pattern_and_positions_at_depth():
    depth = torch.tensor([[2, 3, 3, 4]])  # two context rows, then the nodes at context length + depth
    batch = ForwardBatch.in_cache(cache(), [0], [2], num_new=4, among_new=ancestors(TREE_PARENTS),
                                  positions=depth)
    assert batch.visible()[0].int().tolist() == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 1],
    ]
    assert torch.equal(batch.positions, depth) and batch.kv_length == 6  # rows 2..5 written, scratch past


def test_sliding_window_hides_old_context_keys_only():
    block = ForwardBatch.in_cache(cache(), [0], [4], num_new=2, among_new="all")
    assert block.visible(window=2)[0].int().tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]]
    training = ForwardBatch.standalone(None, torch.tensor([[4, 5]]), "all", torch.arange(4).view(1, -1),
                                       torch.ones(1, 2, 4, dtype=torch.bool))
    assert torch.equal(training.visible(window=2), block.visible(window=2))


def test_attention_over_a_tree_equals_each_branch_alone():
    """Every node of a tree verified in one pass attends exactly as it would at the end of its own chain."""
    gen = torch.Generator().manual_seed(0)
    heads, head_dim = 2, 8
    attn = Attention(0, heads, 1, head_dim)
    kv = cache(head_dim)
    ctx_k, ctx_v = (torch.randn(1, 2, 1, head_dim, generator=gen) for _ in range(2))
    attn.store(ctx_k, ctx_v, ForwardBatch.in_cache(kv, [0], [0], num_new=2))
    q = torch.randn(1, 4, heads, head_dim, generator=gen)
    k, v = (torch.randn(1, 4, 1, head_dim, generator=gen) for _ in range(2))
    tree = ForwardBatch.in_cache(kv, [0], [2], num_new=4, among_new=ancestors(TREE_PARENTS))
    out = attn(q, k, v, tree).view(1, 4, heads, head_dim)
    seen = ancestors(TREE_PARENTS)[0]
    for node in range(4):
        keys = torch.cat([ctx_k[0, :, 0], k[0, seen[node], 0]])  # context, then the node's chain
        values = torch.cat([ctx_v[0, :, 0], v[0, seen[node], 0]])
        weights = torch.softmax(q[0, node] @ keys.t() / math.sqrt(head_dim), dim=-1)
        torch.testing.assert_close(out[0, node], weights @ values)
