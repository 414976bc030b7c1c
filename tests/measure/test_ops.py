"""The op table's storage fields: which block-local storages each call's outputs live in."""

import torch

from remat.measure.ops import OpRecorder


def _table(fn):
    torch.manual_seed(0)
    recorder = OpRecorder(lambda: "blk")
    with recorder:
        fn()
    return {r.key: r for r in recorder.records("blk", {})}


def _toy():
    # x: 4x8 float32 (128 B), w: 8x8; both come from outside the block.
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def forward():
        a = x @ w                                   # storage 0: 4x8 = 128 B
        c = a.t().contiguous()                      # t: a view of 0; clone: storage 1, 128 B
        n = torch.nn.functional.layer_norm(c, (4,))  # out 2 (128 B), mean 3 and rstd 4 (8x1: 32 B each)
        d = torch.nn.functional.dropout(n, 0.5, training=True)  # mask 5 filled in place; out 6
        x.view(32)                                  # a view of the block's input: no block storage
        return d.sum()                              # storage 7: 4 B

    return forward


def test_storage_ids_and_bytes_by_hand():
    table = _table(_toy())
    expected = {
        "aten.mm.default#0": ((0,), (128,)),
        "aten.t.default#0": ((0,), (128,)),
        "aten.clone.default#0": ((1,), (128,)),
        "aten.native_layer_norm.default#0": ((2, 3, 4), (128, 32, 32)),
        "aten.empty_like.default#0": ((5,), (128,)),
        "aten.bernoulli_.float#0": ((5,), (128,)),
        "aten.div_.Scalar#0": ((5,), (128,)),
        "aten.mul.Tensor#0": ((6,), (128,)),
        "aten.view.default#0": ((), ()),
        "aten.sum.default#0": ((7,), (4,)),
    }
    assert {k: (r.storage_ids, r.storage_bytes) for k, r in table.items()} == expected
    assert all(r.storage_escapes == (False,) * len(r.storage_ids) for r in table.values())  # one segment


def test_new_bytes_stay_new_bytes():
    # output_bytes counts only storages the call allocated; views and in-place calls allocate none.
    table = _table(_toy())
    assert [table[k].output_bytes for k in ("aten.mm.default#0", "aten.t.default#0", "aten.native_layer_norm.default#0",
                                            "aten.bernoulli_.float#0", "aten.view.default#0")] == [128, 0, 192, 0, 0]


def test_ids_are_per_segment():
    # A storage made in one segment is foreign to the next: it gets no id there.
    torch.manual_seed(0)
    segment = ["a"]
    recorder = OpRecorder(lambda: segment[0])
    x = torch.randn(4, 4)
    with recorder:
        y = x * 2               # a: storage 0
        segment[0] = "b"
        z = y.t()               # b: a view of a's storage
        (z + 1).relu_()         # b: add -> storage 0 of b; relu_ writes it in place
    a, b = recorder.records("a", {}), recorder.records("b", {})
    # a's storage 0 is only read by b (an add saves nothing): freed after b unless a cache holds it
    assert [(r.key, r.storage_ids, r.storage_escapes) for r in a] == [("aten.mul.Tensor#0", (0,), (False,))]
    assert [(r.key, r.storage_ids, r.storage_bytes, r.storage_escapes) for r in b] == [
        ("aten.t.default#0", (), (), ()), ("aten.add.Tensor#0", (0,), (64,), (False,)),
        ("aten.relu_.default#0", (0,), (64,), (False,))]


def test_a_later_block_saving_a_storage_holds_it():
    # Block b saves a's output (its first saver is a itself, a tanh saving its output): it
    # outlives block a all the same; what b only reads does not.
    from remat.measure.saved import SavedStorage

    segment = ["a"]
    recorder = OpRecorder(lambda: segment[0])
    x = torch.randn(4, 4)
    with recorder:
        y, z = x * 2, x * 3       # a: storages 0 and 1
        segment[0] = "b"
        y * x, z + 1
    key = y.untyped_storage()._cdata
    saved = {key: SavedStorage(nbytes=64, segment="a")}
    recorder.saved_by_call(saved, {key: ["a", "b"]})
    a = recorder.records("a", {})
    assert [(r.storage_ids, r.storage_escapes) for r in a] == [((0,), (True,)), ((1,), (False,))]


def test_post_reading_is_not_holding_but_saving_is():
    # The head ("post") reads block a's two outputs; it saves only the second (first saver):
    # the first is freed after the forward unless cached, so it does not escape.
    from remat.measure.saved import POST, SavedStorage

    torch.manual_seed(0)
    segment = ["a"]
    recorder = OpRecorder(lambda: segment[0])
    x = torch.randn(4, 4)
    with recorder:
        y, z = x * 2, x * 3       # a: storages 0 and 1
        segment[0] = POST
        y.sum(), z.sum()
    saved = {z.untyped_storage()._cdata: SavedStorage(nbytes=64, segment=POST)}
    assert recorder.saved_by_call(saved) == {}
    a = recorder.records("a", {})
    assert [(r.storage_ids, r.storage_escapes) for r in a] == [((0,), (False,)), ((1,), (True,))]


def test_code_between_blocks_reading_is_not_holding_but_saving_is():
    # The code before block b (a patch merging) reads block a's two outputs and saves only the
    # second; block b reads neither: the first is freed after that code unless cached.
    from remat.measure.saved import SavedStorage, between_name

    torch.manual_seed(0)
    segment = ["a"]
    recorder = OpRecorder(lambda: segment[0])
    x = torch.randn(4, 4)
    with recorder:
        y, z = x * 2, x * 3       # a: storages 0 and 1
        segment[0] = between_name(1)
        merged = torch.cat([y, z], dim=1) * torch.cat([z, z], dim=1)
        segment[0] = "b"
        merged + 1
    saved = {z.untyped_storage()._cdata: SavedStorage(nbytes=64, segment=between_name(1))}
    assert recorder.saved_by_call(saved) == {}
    a = recorder.records("a", {})
    assert [(r.storage_ids, r.storage_escapes) for r in a] == [((0,), (False,)), ((1,), (True,))]


def test_a_call_whose_output_is_written_later_is_marked():
    # The dropout toy's mask: empty_like's output is filled by bernoulli_ and div_ (both write
    # into storage 5); nothing writes into the others.
    table = _table(_toy())
    marked = {k for k, r in table.items() if r.mutated_later}
    assert marked == {"aten.empty_like.default#0", "aten.bernoulli_.float#0"}  # div_ is the last write


def test_writes_through_a_view_and_into_out_mark_every_holder_of_the_storage():
    x = torch.randn(4, 8)

    def forward():
        a = x * 2                     # mul#0: storage 0, written below through its view
        v = a.view(32)                # view#0: lives in storage 0 too
        b = x + 1                     # add#0: never written
        s = a.softmax(-1)             # _softmax#0: read before the write, not written
        v.add_(1)                     # add_#0: writes storage 0
        torch.mul(b, 3, out=s)        # mul.out#0 writes into _softmax#0's storage
        return s

    table = _table(forward)
    marked = {k for k, r in table.items() if r.mutated_later}
    assert marked == {"aten.mul.Tensor#0", "aten.view.default#0", "aten._softmax.default#0"}



def test_a_storage_at_the_address_of_a_freed_block_storage_takes_nothing_of_it(monkeypatch):
    """A storage key is an address, which the allocator hands on once the storage is freed. A
    lifted empty constant of DiffusionGemma's (``torch.tensor`` makes it outside the dispatch)
    came at the address of one of its block's freed storages or not, as the allocator gave
    addresses back: its call named that storage's id (one of four) or none, and the op table
    varied from run to run. What was noted of a key holds of a live tensor while the storage
    noted there lives. The allocator's reuse is forced here: the block's 28-byte storage and the
    20-byte tensor from before the block share a key."""
    import remat.measure.ops as ops_module

    real = ops_module.storage_key
    monkeypatch.setattr(ops_module, "storage_key",
                        lambda t: 1 if t.untyped_storage().nbytes() in (20, 28) else real(t))
    x = torch.zeros(5)  # 20 bytes, from before the block
    recorder = OpRecorder(lambda: "blk")
    with recorder:
        made = torch.empty(7)  # storage 0 of the block, 28 bytes, at key 1
        del made
        x.view(5).add_(1)  # at key 1 now: no storage the block made, and nothing of it written
    records = {r.key: r for r in recorder.records("blk", {})}
    assert records["aten.empty.memory_format#0"].storage_ids == (0,)
    assert not records["aten.empty.memory_format#0"].mutated_later
    assert records["aten.view.default#0"].storage_ids == ()
    assert recorder.producer_of(1) is None
