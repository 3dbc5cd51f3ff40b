"""The fused CPU inference ops (RMSNorm, rotary, SiLU gate, attention with and without the KV cache) against
torch's own ops, and the batch invariance they give a block-quantized target: a token's hidden state is the
same bits decoded alone and inside a verify block."""

import pytest
import torch
import torch.nn.functional as F

import blockspec.layers.fused
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.fused import fused_ops
from blockspec.layers.kv_cache import KVCache
from blockspec.models.loader import load_target
from tests.tiny import write_tiny_target

with torch.no_grad():
    OPS = fused_ops(torch.zeros(1))  # loads them
pytestmark = pytest.mark.skipif(OPS is None, reason="blockspec's C++ kernels are not built")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def block_target(tmp_path, qtype: str, activations: str, family: str = "llama"):
    """A tiny target held as `qtype` blocks, multiplied with fp32 or int8 activations."""
    target = load_target(write_tiny_target(tmp_path, family), torch.float32, torch.device("cpu"), qtype)
    if activations == "int8":
        target.use_int8_activations()
    return target


def test_rms_norm_silu_and_rope_match_torch():
    x, w = torch.randn(3, 5, 576, generator=gen(0)), torch.randn(576, generator=gen(1))
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(OPS.rms_norm(x, w, 1e-5), want * w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(OPS.rms_norm(x, None, 1e-5), want, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(2, 3, 2 * 1536, generator=gen(2)) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(OPS.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    qkv = torch.randn(2, 4, 18, 64, generator=gen(3))  # q and k rotate in place; v stays
    cos, sin = torch.randn(2, 4, 1, 64, generator=gen(4)), torch.randn(2, 4, 1, 64, generator=gen(5))
    qk, v = qkv[:, :, :15], qkv[:, :, 15:].clone()
    want = qk * cos + qk.roll(32, dims=-1) * sin
    OPS.rope_(qk, cos, sin)
    assert torch.equal(qkv[:, :, :15], want) and torch.equal(qkv[:, :, 15:], v)


def sdpa(q, k, v, visible):
    """blockspec's attention through torch's SDPA: q [b, n, heads, d], k/v [b, kv, L, d]."""
    b, n, heads, d = q.shape
    groups = heads // k.shape[1]
    mask = None
    if visible is not None:
        additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
        mask = additive.unsqueeze(1).expand(b, groups, n, -1).reshape(b, 1, groups * n, -1)
    q = q.view(b, n, k.shape[1], groups, d).permute(0, 2, 3, 1, 4).reshape(b, k.shape[1], groups * n, d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.view(b, k.shape[1], groups, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, heads * d)


@pytest.mark.parametrize("b,n,length", [(1, 1, 300), (2, 3, 17), (1, 5, 301), (3, 2, 8)])
def test_attention_matches_sdpa(b, n, length):
    q = torch.randn(b, n, 9, 64, generator=gen(0))
    k, v = torch.randn(b, 3, length, 64, generator=gen(1)), torch.randn(b, 3, length, 64, generator=gen(2))
    visible = torch.rand(b, n, length, generator=gen(3)) > 0.3
    visible[..., 0] = True
    torch.testing.assert_close(OPS.attention(q, k, v, visible), sdpa(q, k, v, visible), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(OPS.attention(q, k, v, None), sdpa(q, k, v, None), rtol=1e-5, atol=1e-6)


def test_cache_attention_writes_the_rows_then_attends():
    cache_k, cache_v = torch.zeros(4, 3, 50, 64), torch.zeros(4, 3, 50, 64)
    cache_k[:, :, :20], cache_v[:, :, :20] = torch.randn(2, 4, 3, 20, 64, generator=gen(0))
    q = torch.randn(2, 3, 9, 64, generator=gen(1))
    k, v = torch.randn(2, 3, 3, 64, generator=gen(2)), torch.randn(2, 3, 3, 64, generator=gen(3))
    slots, starts = [3, 1], [20, 18]
    want_k, want_v = cache_k.clone(), cache_v.clone()
    for row, (slot, start) in enumerate(zip(slots, starts)):
        want_k[slot, :, start : start + 3] = k[row].transpose(0, 1)
        want_v[slot, :, start : start + 3] = v[row].transpose(0, 1)
    out = OPS.cache_attention(q, k, v, cache_k, cache_v, slots, starts, 23, None)
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)
    assert torch.equal(out, OPS.attention(q, want_k[slots][:, :, :23], want_v[slots][:, :, :23], None))
    with pytest.raises(RuntimeError, match="outside the cache"):
        OPS.cache_attention(q, k, v, cache_k, cache_v, [3, 1], [48, 0], 23, None)


def test_attention_is_batch_invariant_bitwise():
    """A query over keys 0..p alone gives the same bits as inside a block whose later keys it cannot see."""
    q = torch.randn(1, 5, 9, 64, generator=gen(0))
    k, v = torch.randn(1, 3, 305, 64, generator=gen(1)), torch.randn(1, 3, 305, 64, generator=gen(2))
    visible = torch.arange(305).view(1, 1, -1) <= 300 + torch.arange(5).view(1, -1, 1)
    block = OPS.attention(q, k, v, visible)
    for i in range(5):
        alone = OPS.attention(q[:, i : i + 1], k[:, :, : 301 + i], v[:, :, : 301 + i], None)
        assert torch.equal(block[:, i], alone[:, 0])


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quantized_target_hidden_states_are_batch_invariant(tmp_path, family, activations):
    """Every op on a block-held target's CPU path keeps each row's order fixed: a token's last-layer hidden
    state decoded alone equals, bit for bit, the same token's row in 2-, 5- and 16-token verify blocks."""
    target = block_target(tmp_path, "q8_0", activations, family)
    cache = KVCache.for_model(target, 1, 64)
    tokens = torch.randint(3, target.config.vocab_size, (1, 40), generator=gen(4))
    with torch.inference_mode():
        target(ForwardBatch.in_cache(cache, [0], [0], tokens[:, :20]))
        alone = [target(ForwardBatch.in_cache(cache, [0], [20 + i], tokens[:, 20 + i : 21 + i]))[0][0, 0]
                 for i in range(16)]
        for n in (2, 5, 16):
            block, _ = target(ForwardBatch.in_cache(cache, [0], [20], tokens[:, 20 : 20 + n]))
            for i in range(n):
                assert torch.equal(block[0, i], alone[i]), (n, i)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_tree_node_is_the_same_bits_as_its_path_decoded_alone(tmp_path, family, activations):
    """In a tree's verify pass a node's keys (context and ancestors) sit among other branches' rows; its
    last-layer hidden state still equals, bit for bit, its path's last token decoded alone."""
    target = block_target(tmp_path, "q8_0", activations, family)
    cache = KVCache.for_model(target, 1, 64)
    context = torch.randint(3, target.config.vocab_size, (1, 20), generator=gen(5))
    # root 0; 1, 2 under it; 3 under 2; 4 under 1; 5 under 3; 6 under 4
    parents, tokens = (0, 0, 2, 1, 3, 4), torch.tensor([[7, 8, 9, 10, 11, 12, 13]])
    with torch.inference_mode():
        target(ForwardBatch.in_cache(cache, [0], [0], context))
        tree, _ = target(ForwardBatch.tree(cache, [0], [20], tokens, [parents]))
        for node in range(7):
            path = [node]
            while path[0]:
                path.insert(0, parents[path[0] - 1])
            for depth, step in enumerate(path):
                alone, _ = target(ForwardBatch.in_cache(cache, [0], [20 + depth], tokens[:, step : step + 1]))
            assert torch.equal(tree[0, node], alone[0, 0]), node


def test_fused_forward_matches_the_torch_ops(tmp_path, monkeypatch):
    """The same dense target with the fused ops and with torch's ops: equal up to fp32 rounding."""
    target = load_target(write_tiny_target(tmp_path), torch.float32, torch.device("cpu"))
    tokens = torch.randint(3, target.config.vocab_size, (2, 12), generator=gen(5))

    def run() -> torch.Tensor:
        cache = KVCache.for_model(target, 2, 32)
        target(ForwardBatch.in_cache(cache, [0, 1], [0, 0], tokens[:, :8]))
        return target(ForwardBatch.in_cache(cache, [1, 0], [8, 8], tokens[:, 8:]))[0]

    with torch.inference_mode():
        fused = run()
        monkeypatch.setattr(blockspec.layers.fused, "_UNBUILT", True)
        plain = run()
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_layer_stack_op_equals_the_python_layers_bitwise(tmp_path, activations):
    """A block-held Llama runs its layers as one op (blockspec/kernels/layer_stack.cpp): the same ops in the
    same order as the Python layers, so the same bits, captured features included."""
    target = block_target(tmp_path, "q4_1", activations)
    assert target.block_stack() is not None
    tokens = torch.randint(3, target.config.vocab_size, (2, 12), generator=gen(6))
    last = len(target.layers) - 1

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        cache = KVCache.for_model(target, 3, 32)
        target(ForwardBatch.in_cache(cache, [2, 0], [0, 0], tokens[:, :8]))
        return target(ForwardBatch.in_cache(cache, [0, 2], [8, 8], tokens[:, 8:]), capture=(0, last))

    with torch.inference_mode():
        stacked = run()
        target.__dict__["_block_stack"] = None  # the Python layers, same fused ops
        layered = run()
    assert torch.equal(stacked[0], layered[0]) and torch.equal(stacked[1], layered[1])


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_a_prompt_is_the_same_bits_in_any_chunking(tmp_path, activations):
    """Prefill is chunk-invariant: a 40-token prompt in one chunk, in chunks of 16 + 24, beside another
    sequence, or token by token leaves the same K/V bits in the cache and the same last hidden state (what
    makes a prefix-cache hit, a batched request and a request alone give the same tokens)."""
    target = block_target(tmp_path, "q4_1", activations)
    tokens = torch.randint(3, target.config.vocab_size, (2, 40), generator=gen(7))

    def prefill(chunks: list[int], batched: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = KVCache.for_model(target, 2, 48)
        start = 0
        for size in chunks:
            rows = slice(0, 2) if batched else slice(0, 1)
            hidden, _ = target(ForwardBatch.in_cache(cache, [0, 1][rows], [start, start][rows],
                                                     tokens[rows, start : start + size]))
            start += size
        return hidden[0, -1], cache.k_layers[-1][0, :, :40].clone(), cache.v_layers[-1][0, :, :40].clone()

    with torch.inference_mode():
        want = prefill([40], False)
        for chunks, batched in (([16, 24], False), ([40], True), ([1] * 40, False), ([5, 35], True)):
            got = prefill(chunks, batched)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (chunks, batched)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_a_block_held_draft_runs_as_one_op_with_the_python_layers_bits(tmp_path, activations):
    """A draft held as Q8_0 blocks drafts its block through the layer-stack op (per-head q/k norms, a
    non-causal block) and writes its context through `draft_context`: the same bits as its Python layers."""
    from blockspec.models.loader import load_draft
    from tests.tiny import tiny_target_with_draft

    target, cfg, folder = tiny_target_with_draft(tmp_path, "llama-q4_1", torch.device("cpu"), 4)
    draft = load_draft(folder, cfg, torch.float32, torch.device("cpu"), quantization="q8_0")
    if activations == "int8":
        draft.use_int8_activations()
    draft.use_target_embedding(target.embed_tokens)
    assert draft.block_stack() is not None and draft.context_stack() is not None
    features = torch.randn(2, 7, len(draft.config.target_layer_ids) * cfg.hidden_size, generator=gen(8))
    block = torch.randint(3, cfg.vocab_size, (2, 4), generator=gen(9))

    def run() -> tuple[torch.Tensor, ...]:
        cache = KVCache.for_model(draft, 2, 16)
        draft.inject(features, ForwardBatch.in_cache(cache, [1, 0], [0, 0], num_new=7))
        hidden = draft(ForwardBatch.in_cache(cache, [1, 0], [7, 7], block, among_new="all"))
        return hidden, *(layer[:2, :, :11] for layer in (*cache.k_layers, *cache.v_layers))  # rows written

    with torch.inference_mode():
        fused = run()
        draft.__dict__["_block_stack"] = draft.__dict__["_context_stack"] = None  # the Python layers
        layered = run()
    assert all(torch.equal(a, b) for a, b in zip(fused, layered))
