"""The bucket router on its own: smallest fitting bucket, consistent named dims, padding and un-padding."""

from __future__ import annotations

import pytest
import torch

from neuronbuild.runtime.router import BucketRouter, NoBucketFits

INPUTS = {"ids": {"dtype": "int64", "dims": ["batch", "seq"]}, "mask": {"dtype": "bool", "dims": ["batch", "seq"]}}
BUCKETS = {"b1_s128": {"batch": 1, "seq": 128}, "b4_s64": {"batch": 4, "seq": 64}, "b4_s512": {"batch": 4, "seq": 512}}


def test_picks_the_smallest_bucket_that_fits() -> None:
    r = BucketRouter(INPUTS, BUCKETS)
    assert r.route([(1, 10), (1, 10)]).bucket_name == "b1_s128"  # 128 padded elements < 4 * 64
    assert r.route([(1, 100), (1, 100)]).bucket_name == "b1_s128"
    assert r.route([(2, 64), (2, 64)]).bucket_name == "b4_s64"
    assert r.route([(3, 65), (3, 65)]).bucket_name == "b4_s512"
    with pytest.raises(NoBucketFits, match="no bucket fits batch=5, seq=1"):
        r.route([(5, 1), (5, 1)])
    with pytest.raises(NoBucketFits, match="dim 'seq' is 10 in one input and 11"):
        r.route([(1, 10), (1, 11)])
    with pytest.raises(NoBucketFits, match="expected 2 input"):
        r.route([(1, 10)])


def test_pads_inputs_and_unpads_leading_output_dims() -> None:
    r = BucketRouter(INPUTS, BUCKETS)
    ids = torch.arange(6).reshape(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    route = r.route([ids.shape, mask.shape])
    assert route.bucket_name == "b4_s64" and route.padded
    p_ids, p_mask = r.pad([ids, mask], route)
    assert p_ids.shape == (4, 64) and p_mask.shape == (4, 64)
    assert torch.equal(p_ids[:2, :3], ids) and int(p_ids[2:].abs().sum()) == 0 and not bool(p_mask[:, 3:].any())
    outs = [{"name": "logits", "follows": ["batch", "seq", None]}, {"name": "pooled", "follows": ["batch", None]},
            {"name": "other", "follows": [None]}]
    flat = (torch.randn(4, 64, 7), torch.randn(4, 7), torch.randn(5))
    cut = r.unpad(flat, route, outs)
    assert list(cut) == ["logits", "pooled", "other"]
    assert cut["logits"].shape == (2, 3, 7) and torch.equal(cut["logits"], flat[0][:2, :3])
    assert cut["pooled"].shape == (2, 7) and cut["other"].shape == (5,)


def test_unpads_only_recorded_dims_never_by_equal_sizes() -> None:
    """A KV-cache output [layers, batch, ...] whose layers == the padded batch size keeps its layers dim; BERT's
    pooler_output [batch, hidden] keeps hidden when hidden == the bucket's seq."""
    r = BucketRouter(INPUTS, {"b4_s64": {"batch": 4, "seq": 64}})
    route = r.route([(2, 64), (2, 64)])
    outs = [{"name": "cache", "follows": [None, "batch", None, "seq", None]},
            {"name": "pooler_output", "follows": ["batch", None]}]
    cut = r.unpad((torch.randn(4, 4, 2, 64, 8), torch.randn(4, 64)), route, outs)
    assert cut["cache"].shape == (4, 2, 2, 64, 8)
    assert cut["pooler_output"].shape == (2, 64)
    single = r.unpad(torch.randn(4, 64, 3), route, [{"name": "output", "follows": ["batch", "seq", None]}], "tensor")
    assert isinstance(single, torch.Tensor) and single.shape == (2, 64, 3)
    with pytest.raises(NoBucketFits, match="records no output dims to un-pad"):
        r.unpad(torch.randn(4, 64, 3), route)


def test_a_batch_larger_than_every_bucket_is_cut_into_bucket_sized_chunks() -> None:
    r = BucketRouter(INPUTS, BUCKETS)
    shapes = [(10, 50), (10, 50)]
    with pytest.raises(NoBucketFits, match="no bucket fits batch=10"):
        r.route(shapes)
    assert r.split_dim(shapes) == 4  # the largest batch among buckets with seq >= 50
    assert r.split_dim([(10, 600), (10, 600)]) is None  # seq fits no bucket: splitting batch cannot help
    assert r.split_dim([(3, 50), (3, 50)]) is None  # fits as it is
    assert r.split_dim(shapes, "seq") is None  # seq 50 fits: it is batch that is too large
    ids = torch.arange(500).reshape(10, 50)
    chunks = r.split([ids, ids > 3], 4)
    assert [c[0].shape[0] for c in chunks] == [4, 4, 2] and [r.route([c[0].shape, c[1].shape]).bucket_name
                                                            for c in chunks] == ["b4_s64"] * 3
    assert torch.equal(torch.cat([c[0] for c in chunks]), ids)
    outs = [{"name": "logits", "follows": ["batch", "seq", None]}, {"name": "kv", "follows": [None, "batch"]}]
    parts = [{"logits": torch.full((len(c[0]), 50, 2), float(i)), "kv": torch.full((2, len(c[0])), float(i))}
             for i, c in enumerate(chunks)]
    joined = r.join(parts, outs)
    assert joined["logits"].shape == (10, 50, 2) and joined["kv"].shape == (2, 10)
    assert joined["kv"][0].tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 2
    with pytest.raises(NoBucketFits, match="'pooled' does not follow 'batch'"):
        r.join([{"pooled": torch.zeros(3)}] * 2, [{"name": "pooled", "follows": [None]}])
