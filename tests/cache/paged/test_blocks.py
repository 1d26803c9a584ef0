"""BlockTable: the paged cache's bookkeeping alone (no tensors): reserve, fork, copy-on-write,
free, undo and adopt, with the pool's reference counts checked after every change."""

import ast
import inspect

import pytest

from selfattn.cache.paged import blocks
from selfattn.cache.paged.blocks import BlockTable


def table(num_pages=8, page_size=4, max_seqs=4, max_pages_per_seq=4, **kw) -> BlockTable:
    return BlockTable(num_pages, page_size, max_seqs=max_seqs,
                      max_pages_per_seq=max_pages_per_seq, **kw)  # fmt: skip


def test_blocks_import_no_torch():
    """The bookkeeping module holds no tensors: it imports nothing of torch."""
    tree = ast.parse(inspect.getsource(blocks))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if "torch" in n], names


def test_reserve_allocates_pages_and_advances_lengths():
    t = table()
    a, b = t.add_many(2)
    before, copies = t.reserve([a, b], [5, 3])
    assert before == [(a, 0, 0), (b, 0, 0)] and copies == []
    assert t.pages(a) == [0, 1] and t.pages(b) == [2]
    assert (t.length(a), t.length(b)) == (5, 3)
    assert t.pool.num_free == 5 and t.epoch == 1
    t.check()


def test_fork_shares_pages_and_the_first_write_copies_the_last_one():
    t = table()
    a = t.add()
    t.reserve([a], [6])  # pages [0, 1], page 1 half full
    b = t.fork(a)
    assert t.pages(b) == [0, 1] and t.pool.refcount(0) == t.pool.refcount(1) == 2
    t.check()
    _, copies = t.reserve([b], [1])  # b writes into the shared page 1: copy it first
    assert copies == [(1, 2)] and t.pages(b) == [0, 2] and t.pages(a) == [0, 1]
    assert t.pool.refcount(1) == 1 and t.pool.refcount(2) == 1
    t.check()
    _, copies = t.reserve([a], [1])  # a now holds page 1 alone: writes in place
    assert copies == [] and t.pages(a) == [0, 1]
    t.check()


def test_the_last_sharer_writing_in_one_step_writes_in_place():
    t = table()
    a = t.add()
    t.reserve([a], [2])
    b, c = t.fork(a), t.fork(a)
    _, copies = t.reserve([a, b, c], [1, 1, 1])
    assert len(copies) == 2 and {old for old, _ in copies} == {0}
    assert sorted(p for s in (a, b, c) for p in t.pages(s)).count(0) == 1
    t.check()


def test_a_prefix_ending_on_a_page_boundary_is_never_copied():
    t = table()
    a = t.add()
    t.reserve([a], [4])
    b = t.fork(a)
    _, copies = t.reserve([b], [1])
    assert copies == [] and t.pages(b) == [0, 1]
    t.check()


def test_free_drops_references_and_pages_return_when_unshared():
    t = table()
    a = t.add()
    t.reserve([a], [8])
    b = t.fork(a)
    t.free(a)
    assert t.pool.num_free == 6 and t.seq_ids == [b]
    t.free(b)
    assert t.pool.num_free == 8
    t.truncate(t.add())
    t.check()


@pytest.mark.parametrize("counts, error", [([17], ValueError), ([12, 12, 12], RuntimeError)])
def test_a_refused_reservation_changes_nothing(counts, error):
    t = table(num_pages=6)
    ids = t.add_many(len(counts))
    t.reserve(ids[:1], [1])
    state = ([t.pages(s) for s in ids], [t.length(s) for s in ids], t.pool.num_free, t.epoch)
    with pytest.raises(error, match=r"max_len|free page"):
        t.reserve(ids, counts)
    assert state == ([t.pages(s) for s in ids], [t.length(s) for s in ids], t.pool.num_free,
                     t.epoch)  # fmt: skip
    t.check()


def test_undo_restores_the_latest_step_only():
    t = table()
    a = t.add()
    t.reserve([a], [3])
    before, _ = t.reserve([a], [3])
    epoch = t.epoch
    t.undo(before, epoch)
    assert t.pages(a) == [0] and t.length(a) == 3
    with pytest.raises(RuntimeError, match="only the latest plan"):
        t.undo(before, epoch)
    t.check()


def test_adopt_takes_another_tables_step():
    t = table()
    before = t.adopt([7, 9], [2, 1], [3, 0], [[4, 5], [1]])
    assert before == [(7, 2, 3), (9, 1, 0)]
    assert t.pages(7) == [4, 5] and t.length(7) == 5 and t.length(9) == 1


def test_errors_name_the_value_and_the_fix():
    t = table(max_seqs=1)
    t.add()
    with pytest.raises(RuntimeError, match="max_seqs=1"):
        t.add()
    with pytest.raises(ValueError, match="unknown sequence id 5"):
        t.pages(5)
    with pytest.raises(ValueError, match="repeat a sequence"):
        t.checked_ids([0, 0])
    with pytest.raises(ValueError, match="no prefix index"):
        t.cache_prefix(0, [1, 2])
