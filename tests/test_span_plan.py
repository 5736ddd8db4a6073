"""Span plans: validation (gaps, overlaps, order, bounds, ring), page tables, ring wrap,
and placement independence of the reference attention across plans (CPU)."""
from __future__ import annotations

import pytest
import torch

import kvcompile.ops  # noqa: F401
from kernel_oracle import dense_reference, fill_pools, fresh_seed, placements, rel_err
from kvcompile.errors import KvLayoutError
from kvcompile.kv.span_plan import RESIDENT, RING, Ring, Span, SpanPlan


def test_page_table_follows_spans_in_logical_order():
    ring = Ring(first_physical_page=10, n_slots=4)
    plan = SpanPlan([Span(0, 3, 2, RESIDENT)] + ring.spans(2, 3, start_slot=2), 14, ring)
    table = plan.page_table(length=7)
    print(plan, table.tolist())
    assert plan.n_logical_pages == 5
    assert table.dtype == torch.int32
    assert table.tolist() == [3, 4, 12, 13, 10, 0, 0]


def test_ring_run_splits_at_the_wrap():
    ring = Ring(first_physical_page=100, n_slots=5)
    spans = ring.spans(7, 4, start_slot=3)
    print(spans)
    assert [(s.first_logical_page, s.first_physical_page, s.n_pages) for s in spans] == \
        [(7, 103, 2), (9, 100, 2)]
    assert all(s.kind == RING for s in spans)
    assert len(ring.spans(0, 2, start_slot=1)) == 1          # no wrap needed


BAD = {
    "empty": ([], None, None, "at least one span"),
    "gap": ([Span(0, 0, 2), Span(3, 5, 1)], None, None, "gap in the span plan: logical pages 2..2"),
    "not from zero": ([Span(1, 0, 2)], None, None, "gap in the span plan: logical pages 0..0"),
    "overlap": ([Span(0, 0, 3), Span(2, 5, 2)], None, None, "overlapping or out of order"),
    "out of order": ([Span(2, 0, 1), Span(0, 5, 2)], None, None, "gap|overlapping"),
    "physical overlap": ([Span(0, 0, 3), Span(3, 2, 2)], None, None, "share physical pages"),
    "zero pages": ([Span(0, 0, 0)], None, None, "every span needs >= 1"),
    "negative": ([Span(0, -1, 2)], None, None, "negative page index"),
    "bad kind": ([Span(0, 0, 2, "host")], None, None, "use 'resident' or 'ring'"),
    "past the pool": ([Span(0, 6, 3)], 8, None, "the pool has 8"),
    "ring span outside ring": ([Span(0, 0, 2, RING)], 10, Ring(4, 4), "leaves the ring"),
    "resident inside ring": ([Span(0, 5, 2, RESIDENT)], 10, Ring(4, 4), "overlaps the ring"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_invalid_plans_raise_clear_errors(case):
    spans, n_phys, ring, text = BAD[case]
    with pytest.raises(KvLayoutError, match=text) as e:
        SpanPlan(spans, n_phys, ring)
    print(f"{case}: {e.value}")


def test_other_misuse_raises():
    ring = Ring(0, 3)
    with pytest.raises(KvLayoutError, match="cannot hold a run of 4"):
        ring.spans(0, 4, 0)
    with pytest.raises(KvLayoutError, match="outside 0..2"):
        ring.spans(0, 1, 3)
    plan = SpanPlan([Span(0, 0, 2)])
    with pytest.raises(KvLayoutError, match="pass length >= 2"):
        plan.page_table(length=1)
    with pytest.raises(KvLayoutError, match="add spans for logical pages 2..2"):
        plan.check_covers(n_ctx=40, page_size=16)
    plan.check_covers(n_ctx=32, page_size=16)


@pytest.mark.parametrize("n_ctx", [1, 16, 45, 100])
def test_reference_attention_is_the_same_under_every_placement(n_ctx):
    gen = torch.Generator().manual_seed(fresh_seed())
    page, n_kv, d = 16, 2, 64
    k, v = torch.randn(n_ctx, n_kv, d, generator=gen), torch.randn(n_ctx, n_kv, d, generator=gen)
    q = torch.randn(3, 4, d, generator=gen)
    q_pos = torch.tensor([max(0, n_ctx - 3), max(0, n_ctx - 2), n_ctx - 1], dtype=torch.int32)
    outs = {}
    for name, plan in placements(-(-n_ctx // page), page).items():
        table = plan.page_table(length=plan.n_logical_pages + 2)
        kp, vp = fill_pools(k, v, table, "q8_0", "q4_0", page, plan.num_physical_pages, gen)
        outs[name] = torch.ops.kvcompile.span_attention(q, kp, vp, table, q_pos, 8, 2, page,
                                                        d ** -0.5)
        ref = dense_reference(q, kp, vp, table, q_pos, "q8_0", "q4_0", page, d ** -0.5)
        print(f"{name}: {plan} rel err {rel_err(outs[name], ref):.1e}")
        assert rel_err(outs[name], ref) < 1e-5
    assert all(torch.equal(o, outs["resident"]) for o in outs.values())
