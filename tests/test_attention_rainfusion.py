"""RainFusion rf_v2: plan math and every block-sparse executor against dense SDPA and each other."""

import math

import pytest
import torch

from omnivideo.attention import rainfusion as R
from omnivideo.attention.rows import AttnRows
from omnivideo.attention.torch_impl import block_sparse_gather, rainfusion_reference, sdpa
from omnivideo.backends import PLATFORM, implementations

BS = 32  # small but valid block for tests (production: 128)
GRID, PREFIX = (3, 16, 16), 16  # 784 rows, 25 blocks: first frame = 8 blocks, prefix in the last one


def make_qkv(s, b=1, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g) for _ in range(3)]


@pytest.fixture(scope="module")
def case():
    s = PREFIX + math.prod(GRID)
    q, k, v = make_qkv(s)
    return q, k, v, AttnRows(PREFIX, GRID)


def _flex():
    impl = implementations("attention")["flex_block_sparse"]
    why = impl.unusable_reason(PLATFORM)
    if why is not None:
        pytest.skip(f"flex_block_sparse unusable here: {why}")
    return impl.load()


def _triton():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1 (set by conftest on CPU)")
    from omnivideo.attention.triton_impl import triton_block_sparse

    return triton_block_sparse


# ---- plan math -------------------------------------------------------------------------------


def test_tile_order_permutes_8x8_tiles_and_moves_prefix_to_the_end():
    grid, prefix = (2, 16, 16), 5
    order = R.tile_order(grid, prefix)
    s = prefix + 512
    assert sorted(order.perm.tolist()) == list(range(s))
    assert torch.equal(order.perm[order.inv_perm], torch.arange(s))
    assert (order.n_tiled, order.first_frame) == (512, 256)
    tile = lambda f, r0, c0: [prefix + f * 256 + r * 16 + c for r in range(r0, r0 + 8) for c in range(c0, c0 + 8)]
    assert order.perm[:64].tolist() == tile(0, 0, 0)
    assert order.perm[64:128].tolist() == tile(0, 0, 8)  # next tile along w, then h
    assert order.perm[128:192].tolist() == tile(0, 8, 0)
    assert order.perm[256:320].tolist() == tile(1, 0, 0)  # frame stays outermost
    assert order.perm[-prefix:].tolist() == list(range(prefix))


def test_irregular_grid_tail_becomes_dense_rows():
    grid = (2, 24, 42)  # w = 5 tiles + 2 columns
    order = R.tile_order(grid, 0)
    assert order.n_tiled == 2 * 24 * 40 and order.first_frame == 24 * 40
    tail = order.perm[order.n_tiled :]
    assert tail.numel() == 2 * 24 * 2 and bool(((tail % 42) >= 40).all())
    prot = R.protected_blocks(order, 2016, 128)
    assert prot.tolist() == [True] * 8 + [False] * 7 + [True]  # first frame 960 rows -> 8 blocks; tail from row 1920


@pytest.mark.parametrize("sparsity", [0.7, 0.85, 0.95, 0.8, 0.5, 0.05])
def test_keep_count_is_exact_at_the_boundaries(sparsity):
    """ceil(nb * (1 - s)) in exact decimals for every nb: where binary floating point lands just above an
    integer (nb a multiple of 10 at 0.7, of 20 at 0.85 and 0.95) no extra block is kept. Every device uses it."""
    from fractions import Fraction

    for nb in range(1, 801):
        exact = -(-nb * (100 - round(sparsity * 100)) // 100)  # integer ceil of nb * (1 - s)
        assert R.keep_count(nb, sparsity) == max(1, exact), (nb, sparsity)
    assert R.keep_count(10, 0.7) == 3 and R.keep_count(20, 0.85) == 3 and R.keep_count(20, 0.95) == 1
    assert R.keep_count(10, 0.05 * 14) == 3  # 0.7000000000000001, as a float widget may send it
    assert Fraction(3) != 10 * (1 - 0.7)  # the float product the rule must not use


def test_keep_count_and_pooling():
    assert R.keep_count(25, 0.8) == 5 and R.keep_count(10, 0.8) == 2 and R.keep_count(25, 0.0) == 25
    assert R.keep_count(4, 0.95) == 1
    x = torch.arange(2 * 5 * 1 * 1, dtype=torch.float32).view(2, 5, 1, 1)
    pooled = R.pool_blocks(x, 2)  # blocks of rows (0,1) (2,3) and a partial (4,)
    assert pooled[0, 0, :, 0].tolist() == [0.5, 2.5, 4.0]


def test_block_mask_kept_count_per_head_and_realized_sparsity(case):
    q, k, v, rows = case
    scale = q.shape[-1] ** -0.5
    _, _, _, plan = R.plan_and_permute(q, k, v, rows.grid, rows.prefix_len, 0.8, scale, BS)
    nb = plan.n_blocks
    assert nb == 25 and plan.keep_len == 5
    prot = plan.protected.tolist()
    assert prot == [True] * 8 + [False] * 16 + [True]
    # independent recount: per head, per free query block, the top-keep_len key blocks of the pooled
    # scores plus every protected key block; protected query blocks keep everything
    qp = q[:, plan.order.perm].float().view(1, -1, 2, 16)
    kp = k[:, plan.order.perm].float().view(1, -1, 2, 16)
    for h in range(2):
        expected = 0
        for i in range(nb):
            if prot[i]:
                expected += nb
                continue
            qi = qp[0, i * BS : (i + 1) * BS, h].mean(0)
            scores = torch.stack([qi @ kp[0, j * BS : (j + 1) * BS, h].mean(0) for j in range(nb)]) * scale
            top = set(torch.argsort(scores, descending=True)[: plan.keep_len].tolist())
            expected += len(top | {j for j in range(nb) if prot[j]})
        assert int(plan.block_mask[0, h].sum()) == expected
    num, _ = plan.kv_lists()
    assert plan.realized_sparsity == pytest.approx(1 - int(num.sum()) / (2 * nb * nb))
    assert 0.3 < plan.realized_sparsity < 0.8  # protection makes realized < nominal


# ---- executors -------------------------------------------------------------------------------


def _run(fn, case, sparsity, stats=None):
    q, k, v, rows = case
    return fn(q, k, v, rows=rows, sparsity=sparsity, block_size=BS, stats=stats)


def _one_head(case):  # the Triton interpreter is slow: one head of the same inputs
    q, k, v, rows = case
    return q[:, :, :1], k[:, :, :1], v[:, :, :1], rows


@pytest.mark.parametrize("name", ["reference", "gather", "flex", "triton"])
def test_sparsity_zero_equals_dense(case, name):
    fn = {"reference": rainfusion_reference, "gather": block_sparse_gather}.get(name)
    fn = fn or (_flex() if name == "flex" else _triton())
    case = _one_head(case) if name == "triton" else case
    q, k, v, _ = case
    torch.testing.assert_close(_run(fn, case, 0.0), sdpa(q, k, v), atol=2e-6, rtol=1e-5)


def test_executors_agree_at_sparsity_08_and_protected_rows_are_dense(case):
    q, k, v, _ = case
    dense = sdpa(q, k, v)
    stats = {}
    ref = _run(rainfusion_reference, case, 0.8, stats)
    assert (ref - dense).abs().max() > 1e-2  # really sparse
    assert stats["kept_blocks"] < stats["total_blocks"] and stats["nominal_sparsity"] == 0.8
    torch.testing.assert_close(_run(block_sparse_gather, case, 0.8), ref, atol=2e-6, rtol=1e-5)
    plan = R.plan_and_permute(q, k, v, GRID, PREFIX, 0.8, q.shape[-1] ** -0.5, BS)[3]
    rows = plan.order.perm[R.protected_positions(plan)]
    assert rows.numel() == 9 * BS - (25 * BS - q.shape[1])  # 8 first-frame blocks + the partial prefix block
    assert set(range(PREFIX)) <= set(rows.tolist())
    assert torch.equal(ref[:, rows], dense[:, rows])  # reference: exactly dense
    assert torch.equal(_run(block_sparse_gather, case, 0.8)[:, rows], dense[:, rows])


def test_flex_agrees_with_reference_at_08(case):
    flex = _flex()
    ref = _run(rainfusion_reference, case, 0.8)
    torch.testing.assert_close(_run(flex, case, 0.8), ref, atol=2e-6, rtol=1e-5)


def test_triton_agrees_with_reference_at_08(case):
    tri = _triton()
    case = _one_head(case)
    ref = _run(rainfusion_reference, case, 0.8)
    torch.testing.assert_close(_run(tri, case, 0.8), ref, atol=2e-6, rtol=1e-5)


def test_irregular_grid_24x42_runs_and_matches(case):
    grid, prefix = (2, 24, 42), 8
    q, k, v = make_qkv(prefix + math.prod(grid), h=1, d=16, seed=1)
    rows = AttnRows(prefix, grid)
    dense = sdpa(q, k, v)
    ref0 = rainfusion_reference(q, k, v, rows=rows, sparsity=0.0, block_size=128)
    torch.testing.assert_close(ref0, dense, atol=2e-6, rtol=1e-5)
    ref = rainfusion_reference(q, k, v, rows=rows, sparsity=0.8, block_size=128)
    torch.testing.assert_close(
        block_sparse_gather(q, k, v, rows=rows, sparsity=0.8, block_size=128), ref, atol=2e-6, rtol=1e-5
    )
    tail = R.tile_order(grid, prefix).perm[R.tile_order(grid, prefix).n_tiled :]
    assert torch.equal(ref[:, tail], dense[:, tail])  # irregular remainder + prefix rows are dense rows


def test_triton_production_block_size_with_partial_blocks():
    """Block 128 = two 64-row key slices per kept block, and a partial last block (528 rows)."""
    tri = _triton()
    grid, prefix = (2, 16, 16), 16  # 512 video + 16 prefix rows: 5 blocks of 128, the last one partial
    q, k, v = make_qkv(prefix + 512, h=1, d=16, seed=3)
    rows = AttnRows(prefix, grid)
    for sparsity in (0.0, 0.6):
        ref = rainfusion_reference(q, k, v, rows=rows, sparsity=sparsity, block_size=128)
        out = tri(q, k, v, rows=rows, sparsity=sparsity, block_size=128)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
