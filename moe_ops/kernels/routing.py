"""Fused router: scores, bias, group-limited selection, top-k, renormalisation and scale."""
import triton
import triton.language as tl


@triton.jit
def route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    T, E, stride_lt, stride_le, stride_b,
    top_k, num_groups, group_size, topk_groups, scale,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < T
    col_mask = cols < E
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_lt + cols[None, :] * stride_le,
                mask=mask, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        row_max = tl.max(x, axis=1)
        row_max = tl.where(row_mask, row_max, 0.0)
        p = tl.exp(x - row_max[:, None])
        p = tl.where(mask, p, 0.0)
        denom = tl.sum(p, axis=1)
        denom = tl.where(row_mask, denom, 1.0)
        s = p / denom[:, None]
    s = tl.where(mask, s, 0.0)
    if HAS_BIAS or GROUPED:
        sel = s
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols * stride_b, mask=col_mask, other=0.0).to(tl.float32)
            sel = sel + b[None, :]
    else:
        # softmax and sigmoid are monotone: ranking the logits themselves avoids ties that
        # float32 rounding of exp() would create between close logits.
        sel = x
    # NaN selection scores rank as +inf, first as torch.topk ranks NaN (ties by index): a NaN
    # logit reaches the weights and the output instead of being silently routed around, and
    # with no NaN left the picks below always find a match.
    sel = tl.where(sel == sel, sel, float("inf"))
    sel = tl.where(col_mask[None, :], sel, float("-inf"))

    if GROUPED:
        # A group scores the sum of its two best selection scores; keep the topk_groups best.
        grp = cols // group_size
        gidx = tl.arange(0, BLOCK_G)
        gscore = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
        for g in range(num_groups):
            v = tl.where((grp == g)[None, :] & col_mask[None, :], sel, float("-inf"))
            m1 = tl.max(v, axis=1)
            i1 = tl.min(tl.where(v == m1[:, None], cols[None, :], BLOCK_E), axis=1)
            v2 = tl.where(cols[None, :] == i1[:, None], float("-inf"), v)
            m2 = tl.max(v2, axis=1)
            gs = tl.where(group_size > 1, m1 + m2, m1)
            gs = tl.where(gs == gs, gs, float("inf"))   # +inf + -inf: ranks as NaN does
            gscore = tl.where(gidx[None, :] == g, gs[:, None], gscore)
        # Chosen groups are tracked in a mask, as the experts below: with fewer groups of
        # finite score than topk_groups (-inf bias entries), marking a chosen group -inf let
        # the next pick take it again and leave an allowed group out.
        keep = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
        gavail = tl.broadcast_to((gidx < num_groups)[None, :], (BLOCK_T, BLOCK_G))
        for j in range(topk_groups):
            gm = tl.max(tl.where(gavail, gscore, float("-inf")), axis=1)
            gi = tl.min(tl.where(gavail & (gscore == gm[:, None]), gidx[None, :], BLOCK_G), axis=1)
            keep = tl.where(grp[None, :] == gi[:, None], 1, keep)
            gavail = gavail & (gidx[None, :] != gi[:, None])
        sel = tl.where(keep != 0, sel, float("-inf"))

    kidx = tl.arange(0, BLOCK_K)
    out_w = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    out_i = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    # Experts already picked are tracked in a mask, not by setting their score to -inf: a row
    # with fewer finite scores than top_k (-inf logits) would pick a -inf expert twice. With
    # no NaN left in sel, every pick matches an available expert: the maximum over the
    # available ones is never NaN, and when it is -inf the available -inf experts match. Among
    # equal scores the lowest index wins; the ids of a row are always distinct and in range.
    # Three row reductions per pick (a fourth, for a first-free fallback, cost ~60% of the
    # kernel's time at T >= 512: docs/performance.md).
    avail = tl.broadcast_to(col_mask[None, :], (BLOCK_T, BLOCK_E))
    for j in range(top_k):
        m = tl.max(tl.where(avail, sel, float("-inf")), axis=1)
        i = tl.min(tl.where(avail & (sel == m[:, None]), cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == i[:, None]
        w = tl.sum(tl.where(hit, s, 0.0), axis=1)
        out_w = tl.where(kidx[None, :] == j, w[:, None], out_w)
        out_i = tl.where(kidx[None, :] == j, i[:, None], out_i)
        avail = avail & ~hit
    if RENORMALIZE:
        total = tl.sum(out_w, axis=1)
        total = tl.where(row_mask, total, 1.0)
        out_w = out_w / total[:, None]
    out_w = out_w * scale
    out_mask = row_mask[:, None] & (kidx < top_k)[None, :]
    offs = rows64[:, None] * top_k + kidx[None, :]
    tl.store(weights_ptr + offs, out_w, mask=out_mask)
    tl.store(ids_ptr + offs, out_i, mask=out_mask)
